"""memsvc: the kvstack memory service (KV pool, page allocator, radix cache, host store)."""

__version__ = "0.1.0"
