"""memsvc's flush_cache (what the scheduler's flush_cache runs when idle), in process."""

from __future__ import annotations

import asyncio

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from tests.helpers import small_layout
from tests.scheduler.engine_harness import InProcessMem


def test_flush_evicts_every_unlocked_prefix_and_keeps_the_locked_one() -> None:
    layout = small_layout(page_size=4, num_pages=64, max_running_requests=8, max_context_len=256)
    pool = KVPool(layout)
    try:

        async def scenario() -> None:
            mem = await InProcessMem.connect(MemService(pool, ServiceConfig()))
            for rid, first in (("a", 1), ("b", 50)):
                await mem.alloc_row(rid)
                assert (await mem.alloc_extend([(rid, 16)])).fits
                await mem.release(rid, list(range(first, first + 16)), is_insert=True)
            assert pool.evictable_size() == 32
            # A live request locks 12 tokens of "a": flushing keeps them, and only them
            # (the match split "a" there: its last page and all of "b" go).
            await mem.alloc_row("c")
            assert await mem.match_prefix("c", list(range(1, 13))) == 12
            assert await mem.flush_cache() == 20
            assert pool.evictable_size() == 0 and pool.protected_size() == 12
            pool.check_integrity()
            await mem.free_row("c")
            assert await mem.flush_cache() == 12
            assert pool.evictable_size() == 0 and pool.tree.total_size() == 0
            assert await mem.flush_cache() == 0  # nothing left: a no-op
            pool.check_integrity(idle=True)

        asyncio.run(scenario())
    finally:
        pool.close()
