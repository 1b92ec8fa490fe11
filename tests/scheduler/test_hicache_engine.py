"""The scheduler over memsvc's hierarchical cache (in process, a deterministic fake model):
admission charges what a host hit loads, the tier split of each hit, and normal-mode
retract victims going into the tree's host tier instead of a private host-store entry."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from memsvc.core import KVPool
from memsvc.core.hicache import HiCacheConfig
from memsvc.handlers import MemService, ServiceConfig
from scheduler_svc.core import ReqState
from scheduler_svc.replies import meta_info
from tests.helpers import small_layout
from tests.scheduler.engine_harness import InProcessMem, expected_output
from tests.scheduler.test_engine import Harness, record_adders, run, seed_tree

PAGE = 4


@contextlib.contextmanager
def hicache_service(
    num_pages: int, *, hierarchical: bool = True, load_cost_model: bool = True
) -> Iterator[MemService]:
    layout = small_layout(
        page_size=PAGE, num_pages=num_pages, max_running_requests=16, max_context_len=512
    )
    config = None
    if hierarchical:
        config = HiCacheConfig(ratio=4.0, disable_load_cost_model=not load_cost_model)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes, hicache=config)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


def test_a_host_hit_is_loaded_charged_and_reported_per_tier(monkeypatch) -> None:
    """A prompt cached, then evicted from the device (its host copy stays): the next
    request sharing it gets its 40 tokens loaded back from host. The fresh device pages
    of that load leave the admission budget with the lock, and meta_info says where the
    hit came from."""
    adders = record_adders(monkeypatch)
    # The load cost model is off: with the fake model's instant prefills it could find
    # recomputing cheaper (tests/scheduler/test_hicache_cost_engine.py tests it).
    with hicache_service(num_pages=32, load_cost_model=False) as service:  # 128 tokens

        async def scenario() -> None:
            pool = service.pool
            shared = list(range(1, 41))
            seed_tree(pool, "seed", shared)
            pool.evict(pool.evictable_size())
            assert pool.evictable_size() == 0 and pool.available_size() == 128
            h = await Harness(service).start()
            assert h.engine.hierarchical
            req = h.submit("r", [*shared, 99], 16)
            await h.engine.step()
            assert req.prefix_len == 40
            assert req.cached_tokens_details == {"device": 0, "host": 40}
            # 40 loaded tokens out of the 128, then the charge: a page of extend, the
            # rounding page and the 16 output tokens.
            assert adders[-1].remaining_total_tokens == 128 - 40 - (4 + 4 + 16)
            await h.run()
            done = h.done["r"]
            assert done.output_ids == expected_output([*shared, 99], 16)
            meta = meta_info(done, 0.0)
            assert meta["cached_tokens"] == 40
            assert meta["cached_tokens_details"] == {"device": 0, "host": 40}
            assert h.engine.stats.host_hit_tokens == 40
            pool.check_integrity(idle=True)

        run(scenario())


def test_without_the_hierarchy_meta_info_is_as_before() -> None:
    with hicache_service(num_pages=32, hierarchical=False) as service:

        async def scenario() -> None:
            shared = list(range(1, 41))
            seed_tree(service.pool, "seed", shared)
            h = await Harness(service).start()
            assert not h.engine.hierarchical
            h.submit("r", [*shared, 99], 8)
            await h.run()
            meta = meta_info(h.done["r"], 0.0)
            assert meta["cached_tokens"] == 40 and "cached_tokens_details" not in meta
            service.pool.check_integrity(idle=True)

        run(scenario())


@pytest.mark.parametrize("mode", ["offload", "auto"])
def test_a_retract_victim_goes_into_the_tree_and_comes_back_by_prefix_match(mode) -> None:
    """offload / auto with the hierarchy on: each victim's KV is inserted into the tree
    (and its host tier), not parked privately. While it waits, another session's request
    sharing its tokens hits all of them; its own re-admission recomputes under a page."""
    with hicache_service(num_pages=64, load_cost_model=False) as service:

        async def scenario() -> None:
            h = await Harness(
                service, retract_mode=mode, test_retract=True, test_retract_interval=3
            ).start()
            if mode == "auto":  # make copying look cheap, so that auto picks it
                h.engine.cost.observe_copy(1 << 30, 1e-3)
                h.engine.cost.observe_prefill(1, 1.0)
            prompts = {f"r{i}": [10 * i + j for j in range(1, 14 + 3 * i)] for i in range(3)}
            for rid, prompt in prompts.items():
                h.submit(rid, prompt, 20)
            peer = await InProcessMem.connect(service, name="peer")
            checked = False
            for _ in range(2000):
                if not await h.engine.step() and h.engine.idle:
                    break
                victim = next((r for r in h.engine.waiting if r.is_retracted), None)
                if victim is not None and not checked:
                    await peer.alloc_row("peer")
                    match = await peer.match_prefix_tiers("peer", victim.fill_ids[:-1])
                    await peer.free_row("peer")
                    assert match.prefix_len == (victim.seq_len - 1) // PAGE * PAGE
                    checked = True
            assert checked, "no request was retracted"
            stats = h.engine.stats
            assert stats.retracted_reqs > 0
            assert stats.tree_retracted_reqs == stats.retracted_reqs
            assert stats.offloaded_reqs == 0 and stats.loaded_reqs == 0
            assert stats.reprefilled_tokens <= PAGE * stats.retracted_reqs
            for rid, prompt in prompts.items():
                assert h.done[rid].state is ReqState.FINISHED
                assert h.done[rid].output_ids == expected_output(prompt, 20)
            service.pool.check_integrity(idle=True)

        run(scenario())


def test_without_the_hierarchy_offload_keeps_its_private_host_entries() -> None:
    with hicache_service(num_pages=64, hierarchical=False) as service:

        async def scenario() -> None:
            h = await Harness(
                service, retract_mode="offload", test_retract=True, test_retract_interval=3
            ).start()
            prompts = {f"r{i}": [10 * i + j for j in range(1, 14 + 3 * i)] for i in range(3)}
            for rid, prompt in prompts.items():
                h.submit(rid, prompt, 20)
            await h.run()
            stats = h.engine.stats
            assert stats.retracted_reqs > 0 and stats.tree_retracted_reqs == 0
            assert stats.loaded_reqs == stats.offloaded_reqs > 0
            for rid, prompt in prompts.items():
                assert h.done[rid].output_ids == expected_output(prompt, 20)
            service.pool.check_integrity(idle=True)

        run(scenario())
