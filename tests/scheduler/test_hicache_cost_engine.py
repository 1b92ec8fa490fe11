"""The scheduler feeds memsvc's load-or-recompute model (memsvc.core.hicache_cost): with
each admission it sends the prefill time per token it measured, and a host hit that
its worker recomputes faster than memsvc copies it is recomputed, the output unchanged."""

from __future__ import annotations

from memsvc.handlers import MemService
from tests.scheduler.engine_harness import expected_output
from tests.scheduler.test_engine import Harness, run, seed_tree
from tests.scheduler.test_hicache_engine import hicache_service

SHARED = list(range(1, 41))


async def host_only_prompt(service: MemService) -> Harness:
    """SHARED cached, then evicted from the device (its host copy stays); a started engine."""
    seed_tree(service.pool, "seed", SHARED)
    service.pool.evict(service.pool.evictable_size())
    return await Harness(service).start()


def test_a_host_hit_cheaper_to_recompute_is_recomputed() -> None:
    with hicache_service(num_pages=32) as service:

        async def scenario() -> None:
            pool = service.pool
            h = await host_only_prompt(service)
            assert pool.hicache.cost.recompute_s_per_token is None  # nothing measured yet
            h.engine.cost.observe_prefill(10**9, 1e-3)  # a worker far faster than any copy
            req = h.submit("r", [*SHARED, 99], 8)
            await h.engine.step()
            assert pool.hicache.cost.recompute_s_per_token < 1e-9
            assert req.prefix_len == 0 and req.cached_tokens_details == {"device": 0, "host": 0}
            assert pool.hicache.stats.load_skips["cost"] == 1
            assert pool.hicache.stats.load_skip_tokens["cost"] == 40
            await h.run()
            assert h.done["r"].output_ids == expected_output([*SHARED, 99], 8)
            assert h.engine.stats.host_hit_tokens == 0
            pool.check_integrity(idle=True)

        run(scenario())


def test_a_host_hit_dearer_to_recompute_is_loaded() -> None:
    with hicache_service(num_pages=32) as service:

        async def scenario() -> None:
            pool = service.pool
            h = await host_only_prompt(service)
            h.engine.cost.prefill_tokens_per_s = 1.0  # a token a second: any copy is cheaper
            h.engine.cost.prefill_observed = True
            req = h.submit("r", [*SHARED, 99], 8)
            await h.engine.step()
            assert pool.hicache.cost.recompute_s_per_token > 0.1
            assert req.prefix_len == 40 and req.cached_tokens_details == {"device": 0, "host": 40}
            assert pool.hicache.stats.load_skips["cost"] == 0
            await h.run()
            assert h.done["r"].output_ids == expected_output([*SHARED, 99], 8)
            pool.check_integrity(idle=True)

        run(scenario())
