"""memsvc's replies, stats and metrics for a hybrid (sliding-window) pool: both pools' sizes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.core import KVPool, PoolLayout
from memsvc.handlers import MemService, ServiceConfig
from memsvc.handlers_batch import ADMIT_COLUMNS
from memsvc.metrics import Metrics
from tests.service.test_batch_ops import admit
from tests.service.test_handlers import Caller, ids

F, S = "full_attention", "sliding_attention"


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = PoolLayout(
        num_layers=3,
        layer_types=(S, F, S),
        sliding_window=4,
        swa_num_pages=8,
        num_kv_heads=1,
        head_dim=2,
        page_size=4,
        num_pages=16,
        max_running_requests=4,
        max_context_len=64,
        dtype="float32",
    )
    pool = KVPool(layout)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


def test_replies_and_stats_carry_both_pools(service: MemService) -> None:
    c = Caller(service)
    c.hello()
    row = c.ok("alloc_row", rid="a")["row"]
    reply = c.ok("alloc_extend", {"num_tokens": ids(12)}, rids=["a"])
    # 3 pages of each pool; "available" is what an allocation can have: min of the two
    assert reply["full_available"] == 64 - 12 and reply["swa_available"] == 32 - 12
    assert reply["available"] == 32 - 12
    assert reply["swa_evictable"] == 0 and reply["swa_protected"] == 0
    for _ in range(2):  # the second step frees the pages that left every window
        step = c.ok("decode_step", {"rows": ids(row)})
    assert step["full_available"] == 64 - 16 and step["swa_available"] == 32 - 16 + 8
    stats = c.ok("stats")
    assert stats["swa"] == {
        "full_available": 48,
        "swa_available": 24,
        "swa_evictable": 0,
        "swa_protected": 0,
        "swa_capacity": 32,
        "swa_held": 8,
        "sliding_window": 4,
    }
    tokens = np.arange(1, 15)
    c.ok("release", {"token_ids": tokens}, rid="a", is_insert=True)
    # the tree holds 12 tokens of full KV; their SWA KV only for the last page
    stats = c.ok("stats")["swa"]
    assert stats["swa_evictable"] == 4 and stats["swa_available"] == 28
    assert service.pool.evictable_size() == 12
    reply = admit(c, [("b", tokens[:13]), ("c", tokens[:6])])
    got = reply["matches"].reshape(-1, len(ADMIT_COLUMNS))[:, ADMIT_COLUMNS.index("prefix_len")]
    # b's window needs the last page, held; c's match to 4 would need page 0's SWA: gone
    assert got.tolist() == [12, 0]
    assert reply["before_swa"] == [64 - 12, 28, 4, 0]
    assert reply["swa_pinned"].tolist() == [4, 0]
    assert reply["swa_protected"] == 4
    c.ok("free_row", rid="b")
    c.ok("free_row", rid="c")
    c.ok("check", idle=True)


def test_metrics_export_the_swa_pool(service: MemService) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    metrics = Metrics(registry)
    metrics.watch(service)
    c = Caller(service)
    c.hello()
    c.ok("alloc_row", rid="a")
    c.ok("alloc_extend", {"num_tokens": ids(8)}, rids=["a"])
    swa = {
        s.labels["state"]: s.value
        for f in registry.collect()
        if f.name == "memsvc_swa_tokens"
        for s in f.samples
    }
    assert swa == {
        "capacity": 32,
        "available": 24,
        "evictable": 0,
        "protected": 0,
        "held": 8,
        "used": 8,
    }
    usage = registry.get_sample_value("memsvc_swa_token_usage")
    assert usage == pytest.approx(8 / 32)
    assert registry.get_sample_value("memsvc_tokens", {"state": "available"}) == 56
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)
