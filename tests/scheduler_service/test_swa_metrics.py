"""A hybrid model's two pools in the scheduler's metrics (issue 29, item 6).

memsvc's own two pools in process (W = 8; one full and one sliding layer), an
engine over them, scraped mid-run and idle: ``sglang:swa_token_usage`` and
``sglang:full_token_usage`` are each pool's used / capacity, ``sglang:token_usage``
and ``sglang:num_used_tokens`` the larger pool's (SGLang's), the ``kv_*_tokens``
gauges the full pool's, and kvstack's ``kvstack_swa_kv_tokens{state}`` the SWA
pool's by state; all read off the pool itself at the moment of the scrape.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from scheduler_svc import metrics
from tests.helpers import small_layout
from tests.scheduler_service.test_sglang_metrics import (
    PAGE,
    scrape,
    service,  # noqa: F401 (the fixture: a pool without sliding layers)
    start_engine,
    submit,
    value,
)

SWA_PAGES = 24


def test_both_pools_usage_follows_the_pool() -> None:
    layout = small_layout(
        page_size=PAGE,
        layer_types=("full_attention", "sliding_attention"),
        sliding_window=8,
        swa_num_pages=SWA_PAGES,
    )
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    hybrid = MemService(pool, ServiceConfig(retract_decode_steps=20))
    full_capacity = layout.num_pages * PAGE
    swa_capacity = SWA_PAGES * PAGE

    def expected() -> dict[str, float]:
        full_used = full_capacity - pool.full_available_size() - pool.evictable_size()
        swa_used = swa_capacity - pool.swa_available_size() - pool.swa_evictable_size()
        return {"full": full_used, "swa": swa_used}

    async def scenario() -> None:
        engine = await start_engine(hybrid)
        assert engine.swa is not None and engine.swa.capacity == swa_capacity
        registry = CollectorRegistry()
        metrics.register(registry, engine, model_name="smol")
        for i in range(4):
            submit(engine, f"r{i}", [i + 2] * (20 + 4 * i), 12)
        checked = 0
        for _ in range(200):
            await engine.step()
            want = expected()
            families = scrape(registry)
            full_usage = want["full"] / full_capacity
            swa_usage = want["swa"] / swa_capacity
            assert value(families, "sglang:full_token_usage") == full_usage
            assert value(families, "sglang:swa_token_usage") == swa_usage
            assert value(families, "sglang:token_usage") == round(max(full_usage, swa_usage), 2)
            assert value(families, "sglang:num_used_tokens") == max(want["full"], want["swa"])
            assert value(families, "sglang:kv_used_tokens") == want["full"]
            assert value(families, "sglang:kv_available_tokens") == pool.full_available_size()
            states = {s.labels["state"]: s.value for s in families["kvstack_swa_kv_tokens"].samples}
            assert states == {
                "used": want["swa"],
                "evictable": pool.swa_evictable_size(),
                "available": pool.swa_available_size(),
            }
            assert value(families, "kvstack_swa_token_usage", {}) == swa_usage
            # while prompts run, the SWA pool holds windows, the full pool whole contexts
            checked += want["swa"] > 0 and want["full"] > want["swa"]
            if engine.idle:
                break
        assert engine.idle and checked > 0
        families = scrape(registry)
        assert value(families, "sglang:swa_token_usage") == 0
        assert value(families, "sglang:full_token_usage") == 0
        pool.check_integrity(idle=True)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_a_pool_without_sliding_layers_has_no_swa_families(service) -> None:  # noqa: F811
    async def scenario() -> None:
        engine = await start_engine(service)
        registry = CollectorRegistry()
        metrics.register(registry, engine, model_name="smol")
        families = scrape(registry)
        assert "sglang:swa_token_usage" not in families
        assert "kvstack_swa_kv_tokens" not in families
        assert "sglang:full_token_usage" in families
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())
