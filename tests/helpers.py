"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memsvc.core import KVPool, PoolLayout
from memsvc.handlers import MemService, ServiceConfig


def small_layout(**overrides: int | str) -> PoolLayout:
    fields: dict = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        page_size=4,
        num_pages=64,
        max_running_requests=16,
        max_context_len=512,
    )
    fields.update(overrides)
    return PoolLayout(**fields)


@contextlib.contextmanager
def pool_service(
    page_size: int = 4, num_pages: int = 64, host_pools: int = 1
) -> Iterator[MemService]:
    """An in-process memsvc over a small pool, closed after.

    Its host store holds ``host_pools`` times the pool.
    """
    layout = small_layout(page_size=page_size, num_pages=num_pages)
    pool = KVPool(layout, host_store_bytes=host_pools * layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()
