"""KV buffer backends: where the pool's bytes live and how other processes map them.

``shm`` (default): POSIX shared memory, numpy in the owner, numpy or torch
views in attachers. ``cuda``: cupy device buffers shared by CUDA IPC, pinned
host memory for the host store; cupy is imported only when it is chosen.
"""

from __future__ import annotations

from typing import Any

from memsvc.core.backends.base import AttachedBuffers, KVBuffers
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.layout import PoolLayout

BACKENDS = ("shm", "cuda")


def create_buffers(layout: PoolLayout, backend: str = "shm", **options: Any) -> KVBuffers:
    """Allocate the KV buffer and the ``req_to_token`` table for ``layout``."""
    if backend == "shm":
        from memsvc.core.backends.shm import ShmBuffers

        return ShmBuffers(layout, **options)
    if backend == "cuda":
        from memsvc.core.backends.cuda import CudaBuffers

        return CudaBuffers(layout, **options)
    raise InvalidArgumentError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


def attach(handle: dict[str, Any]) -> AttachedBuffers:
    """Map another process's pool from the handle it published (zero-copy)."""
    backend = handle.get("backend")
    if backend == "shm":
        from memsvc.core.backends.shm import ShmAttached

        return ShmAttached(handle)
    if backend == "cuda":
        from memsvc.core.backends.cuda import CudaAttached

        return CudaAttached(handle)
    raise InvalidArgumentError(f"unknown backend in handle: {backend!r}")


__all__ = ["BACKENDS", "AttachedBuffers", "KVBuffers", "attach", "create_buffers"]
