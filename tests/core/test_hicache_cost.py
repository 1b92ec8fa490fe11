"""The hierarchical cache's load-or-recompute model (memsvc.core.hicache_cost): a host hit
is loaded only when copying it is no dearer than recomputing it, SGLang's load-back
threshold stays the floor, and every skip is counted (stats, metrics); the scheduler's
prefill rate reaches the model through ``admit``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from memsvc.core import KVPool
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.hicache import HiCacheConfig
from memsvc.core.hicache_cost import LoadCostModel
from memsvc.handlers import MemService, ServiceConfig
from memsvc.metrics import Metrics
from scheduler_svc.core.retract_cost import RetractCostModel
from tests.core.test_hicache import finish, layout, run_request, seq
from tests.helpers import small_layout
from tests.service.test_batch_ops import PROMPT, Caller, admit, cache_prompt, matches

SLOW = 1e-3  # s per token: recomputing is far dearer than copying a few hundred bytes
FAST = 1e-12  # s per token: recomputing is cheaper than any copy


def make_pool(**config) -> KVPool:
    lay = layout(8)
    config.setdefault("copy_gb_per_s", 1.0)  # 1e9 B/s, no latency: a known copy cost
    return KVPool(lay, hicache=HiCacheConfig(size_bytes=8 * lay.bytes_per_page, **config))


def cached_then_evicted(pool: KVPool, tokens: np.ndarray) -> None:
    run_request(pool, "seed", tokens)
    pool.evict(pool.evictable_size())
    assert pool.hicache.tier_tokens()["host_only"] == len(tokens) - 1


def test_the_model_compares_a_copy_with_a_recompute():
    model = LoadCostModel(enabled=True, copy_latency_s=1e-4, copy_bytes_per_s=1e9)
    assert model.worth_loading(100, 10**6)  # rate unknown: load, as without the model
    model.observe_recompute(2e-5)  # 100 tokens: 2 ms to recompute, 1.1 ms to copy
    assert model.worth_loading(100, 10**6)
    model.observe_recompute(1e-5)  # 1 ms to recompute
    assert not model.worth_loading(100, 10**6)
    assert model.worth_loading(100, 10**5)  # 0.2 ms to copy
    model.observe_recompute(0.0)  # ignored: not a rate
    assert model.recompute_s_per_token == 1e-5
    off = LoadCostModel(
        enabled=False, copy_latency_s=1.0, copy_bytes_per_s=1.0, recompute_s_per_token=FAST
    )
    assert off.worth_loading(100, 10**9)


def test_a_load_dearer_than_recomputing_is_skipped_and_counted():
    pool = make_pool()
    tree = pool.hicache
    tokens = seq(7, 3)
    cached_then_evicted(pool, tokens)
    tree.cost.observe_recompute(FAST)
    m = run_request(pool, "a", tokens)  # recomputed, inserted again over its host copy
    assert (m.prefix_len, m.host_tokens) == (0, 0)
    assert tree.stats.load_tokens == 0
    assert tree.stats.load_skips == {"threshold": 0, "cost": 1}
    assert tree.stats.load_skip_tokens == {"threshold": 0, "cost": 12}
    stats = tree.stats_dict()
    assert stats["load_skips"]["cost"] == 1 and stats["load_skip_tokens"]["cost"] == 12
    assert stats["load_cost_model"]["recompute_s_per_token"] == FAST
    # the scheduler measures a slower worker: the same hit is loaded now
    pool.evict(pool.evictable_size())
    tree.cost.observe_recompute(SLOW)
    m = run_request(pool, "b", tokens)
    assert (m.prefix_len, m.host_tokens) == (12, 12)
    assert tree.stats.load_tokens == 12 and tree.stats.load_skips["cost"] == 1
    finish(pool)


def test_the_threshold_stays_the_floor():
    """However dear recomputing is, an 8-token host tail (under 10) is not loaded."""
    pool = make_pool()
    tree = pool.hicache
    tree.cost.observe_recompute(SLOW)
    tokens = seq(8, 2)
    cached_then_evicted(pool, tokens)
    m = run_request(pool, "a", tokens)
    assert (m.prefix_len, m.host_tokens) == (0, 0)
    assert tree.stats.load_skips == {"threshold": 1, "cost": 0}
    assert tree.stats.load_skip_tokens == {"threshold": 8, "cost": 0}
    finish(pool)


def test_disabled_or_fixed_by_flag():
    pool = make_pool(disable_load_cost_model=True)
    pool.hicache.cost.observe_recompute(FAST)  # the model is off: loaded all the same
    tokens = seq(9, 3)
    cached_then_evicted(pool, tokens)
    assert run_request(pool, "a", tokens).host_tokens == 12
    assert pool.hicache.stats.load_skips["cost"] == 0
    finish(pool)
    # --hicache-recompute-us-per-token: what the scheduler sends does not move it
    pool = make_pool(recompute_us_per_token=1e-6)
    pool.hicache.cost.observe_recompute(SLOW)
    assert pool.hicache.cost.recompute_s_per_token == pytest.approx(1e-12)
    cached_then_evicted(pool, tokens)
    assert run_request(pool, "a", tokens).host_tokens == 0
    assert pool.hicache.stats.load_skips["cost"] == 1
    finish(pool)
    with pytest.raises(InvalidArgumentError, match="copy-bandwidth"):
        HiCacheConfig(copy_gb_per_s=-1.0)
    with pytest.raises(InvalidArgumentError, match="recompute-us-per-token"):
        HiCacheConfig(recompute_us_per_token=math.nan)


def test_the_copy_path_is_calibrated_at_start():
    lay = layout(8)
    pool = KVPool(lay, hicache=HiCacheConfig(size_bytes=8 * lay.bytes_per_page))
    cost = pool.hicache.cost.as_dict()
    assert cost["enabled"] and cost["recompute_s_per_token"] is None
    assert 0 < cost["copy_bytes_per_s"] < math.inf and cost["copy_latency_s"] >= 0
    assert pool.available_size() == pool.capacity  # it used the pool's pages, gave them back
    tokens = seq(10, 3)
    cached_then_evicted(pool, tokens)
    assert run_request(pool, "a", tokens).host_tokens == 12  # nothing says recompute is cheap
    finish(pool)


def test_admit_passes_the_schedulers_rate_and_metrics_count_skips():
    lay = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    config = HiCacheConfig(size_bytes=8 * lay.bytes_per_page, copy_gb_per_s=1.0)
    pool = KVPool(lay, host_store_bytes=lay.kv_bytes, hicache=config)
    registry = CollectorRegistry()
    service = MemService(pool, ServiceConfig(retract_decode_steps=4), Metrics(registry))
    service.metrics.watch(service)
    try:
        c = Caller(service)
        c.hello()
        cache_prompt(c)
        c.ok("flush_cache", device_only=True)  # device -> host
        reply = admit(c, [("a", PROMPT[:12])], recompute_s_per_token=FAST)
        (a,) = matches(reply)
        assert (a["prefix_len"], a["host_hit"], a["pinned"]) == (0, 0, 0)
        assert pool.hicache.cost.recompute_s_per_token == FAST
        c.ok("free_row", rid="a")
        assert not admit(c, [("b", PROMPT[:12])], recompute_s_per_token=-1.0)["ok"]
        (b,) = matches(admit(c, [("b", PROMPT[:12])], recompute_s_per_token=SLOW))
        assert (b["prefix_len"], b["host_hit"]) == (12, 12)
        c.ok("free_row", rid="b")
        text = generate_latest(registry).decode()
        assert 'kvstack_hicache_load_skips_total{reason="cost"} 1.0' in text
        assert 'kvstack_hicache_load_skip_tokens_total{reason="cost"} 12.0' in text
        assert 'kvstack_hicache_load_skips_total{reason="threshold"} 0.0' in text
        assert "kvstack_hicache_copy_bytes_per_second 1e+09" in text
        assert f"kvstack_hicache_recompute_seconds_per_token {SLOW}" in text
        c.ok("check", idle=True)
    finally:
        pool.close()


def test_the_scheduler_sends_a_rate_only_once_it_measured_one():
    model = RetractCostModel(bytes_per_token=1, page_size=4)
    assert model.recompute_s_per_token() is None  # the prior is a guess
    model.observe_prefill(100, 0.5)
    assert model.recompute_s_per_token() == pytest.approx(1 / model.prefill_tokens_per_s)
