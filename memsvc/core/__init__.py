"""The pure memsvc core: plain synchronous classes, no ZMQ, no asyncio."""

from memsvc.core.allocator import PageAllocator
from memsvc.core.backends import attach, create_buffers
from memsvc.core.hicache import HiCacheConfig, HiRadixCache
from memsvc.core.host_store import HostStore
from memsvc.core.layout import PoolLayout
from memsvc.core.pool import KVPool, ReqKV
from memsvc.core.radix_cache import RadixCache
from memsvc.core.req_to_token import ReqToTokenTable

__all__ = [
    "HiCacheConfig",
    "HiRadixCache",
    "HostStore",
    "KVPool",
    "PageAllocator",
    "PoolLayout",
    "RadixCache",
    "ReqKV",
    "ReqToTokenTable",
    "attach",
    "create_buffers",
]
