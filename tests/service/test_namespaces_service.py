"""Cache namespaces on the socket (issue 30): ``alloc_row namespace``, ``admit
namespaces``, ``flush_cache namespace``, the stats reply's ``namespaces`` and the
Prometheus series; a bad namespace is a clear error that changes nothing. Each test
ends with the pool's idle integrity check."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from memsvc.metrics import Metrics
from memsvc.namespace import namespace_label, namespace_of
from tests.helpers import small_layout
from tests.service.test_batch_ops import admit, matches
from tests.service.test_handlers import Caller, ids

A = namespace_of("tenant-a", None)
B = namespace_of(None, "extra-b")
PROMPT = np.arange(100, 113, dtype=np.int64)  # 13 tokens: 12 cached (3 pages of 4)


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


def cache_prompt(c: Caller, rid: str, namespace: str | None) -> None:
    fields = {} if namespace is None else {"namespace": namespace}
    c.ok("alloc_row", rid=rid, **fields)
    c.ok("alloc_extend", {"num_tokens": ids(13)}, rids=[rid])
    c.ok("release", {"token_ids": PROMPT}, rid=rid, is_insert=True)


def prefix_len(c: Caller, rid: str, namespace: str | None) -> int:
    fields = {} if namespace is None else {"namespace": namespace}
    c.ok("alloc_row", rid=rid, **fields)
    hit = c.ok("match_prefix", {"token_ids": PROMPT[:-1]}, rid=rid)["prefix_len"]
    c.ok("free_row", rid=rid)
    return hit


def idle(c: Caller) -> None:
    c.ok("check", idle=True)


def test_alloc_row_opens_the_row_in_its_namespace(service) -> None:
    c = Caller(service)
    c.hello()
    cache_prompt(c, "w", A)
    assert prefix_len(c, "b", B) == 0
    assert prefix_len(c, "d", None) == 0
    assert prefix_len(c, "d2", "") == 0
    assert prefix_len(c, "a", A) == 12
    idle(c)


def test_admit_opens_each_rid_in_its_namespace(service) -> None:
    c = Caller(service)
    c.hello()
    cache_prompt(c, "w", A)
    items = [("x", PROMPT[:-1]), ("y", PROMPT[:-1]), ("z", PROMPT[:-1])]
    reply = admit(c, items, namespaces=[B, A, ""])
    assert reply["ok"], reply
    assert [m["prefix_len"] for m in matches(reply)] == [0, 12, 0]
    assert service.pool.request("y").namespace == A
    for rid in ("x", "y", "z"):
        c.ok("free_row", rid=rid)
    reply = admit(c, [("x", PROMPT[:-1])])  # no namespaces: the default one
    assert [m["prefix_len"] for m in matches(reply)] == [0]
    c.ok("free_row", rid="x")
    idle(c)


@pytest.mark.parametrize(
    ("op", "fields", "arrays"),
    [
        ("alloc_row", {"rid": "r", "namespace": "TENANT"}, None),
        ("alloc_row", {"rid": "r", "namespace": "a" * 33}, None),
        ("alloc_row", {"rid": "r", "namespace": 7}, None),
        ("flush_cache", {"namespace": "ab"}, None),
        ("admit", {"rids": ["r"], "namespaces": ["Z" * 32]}, "batch"),
        ("admit", {"rids": ["r"], "namespaces": [A, B]}, "batch"),
        ("admit", {"rids": ["r"], "namespaces": A}, "batch"),
    ],
)
def test_a_bad_namespace_is_a_clear_error_and_changes_nothing(service, op, fields, arrays):
    c = Caller(service)
    c.hello()
    cache_prompt(c, "w", A)
    before = dict(service.pool.tree.namespace_tokens())
    if arrays == "batch":
        arrays = {"token_ids": PROMPT[:-1], "token_lens": ids(12)}
    reply = c.call(op, arrays, **fields)
    assert not reply["ok"] and reply["code"] == "bad_request", reply
    assert "namespace" in reply["message"]
    assert not service.pool.is_open("r")
    assert service.pool.tree.namespace_tokens() == before
    assert prefix_len(c, "a", A) == 12
    idle(c)


def test_flush_cache_of_one_namespace_leaves_the_others(service) -> None:
    c = Caller(service)
    c.hello()
    cache_prompt(c, "wa", A)
    cache_prompt(c, "wb", B)
    cache_prompt(c, "wd", None)
    assert c.ok("flush_cache", namespace=A)["evicted"] == 12
    assert prefix_len(c, "a", A) == 0
    assert prefix_len(c, "b", B) == 12
    assert prefix_len(c, "d", None) == 12
    assert c.ok("flush_cache", namespace="")["evicted"] == 12
    assert prefix_len(c, "b", B) == 12
    assert c.ok("flush_cache")["evicted"] == 12  # everything left
    idle(c)


def test_stats_and_metrics_list_namespaces_by_label(service) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    service.metrics = Metrics(registry)
    service.metrics.watch(service)
    c = Caller(service)
    c.hello()
    cache_prompt(c, "wa", A)
    assert prefix_len(c, "a", A) == 12
    cache_prompt(c, "wd", None)
    stats = c.ok("stats")["namespaces"]
    label = namespace_label(A)
    assert set(stats) == {label, "default"}
    assert stats[label]["cached_tokens"] == 12 and stats[label]["device_hit_tokens"] == 12
    assert stats[label]["host_hit_tokens"] == stats[label]["storage_hit_tokens"] == 0
    assert stats["default"]["cached_tokens"] == 12
    text = prometheus.generate_latest(registry).decode()
    assert f'memsvc_namespace_cached_tokens{{namespace="{label}"}} 12.0' in text
    assert f'memsvc_namespace_hit_tokens_total{{namespace="{label}",tier="device"}} 12.0' in text
    assert A not in text  # a label is a prefix of the digest, never the whole
    idle(c)


def test_the_python_client_passes_namespaces(service) -> None:
    """``alloc_row(rid, namespace)``, ``admit(..., namespaces=)`` and
    ``flush_cache(namespace=)`` as the scheduler calls them (the real client ops)."""
    import asyncio

    from memsvc.inproc import InProcessMem

    async def run() -> None:
        mem = await InProcessMem.connect(service)
        await mem.alloc_row("w", namespace=A)
        await mem.alloc_extend([("w", 13)])
        await mem.release("w", PROMPT, is_insert=True)
        result = await mem.admit([("x", PROMPT[:-1]), ("y", PROMPT[:-1])], namespaces=[B, A])
        assert [m.prefix_len for m in result.matches] == [0, 12]
        await mem.free_row("x")
        await mem.free_row("y")
        assert await mem.flush_cache(namespace=B) == 0
        assert await mem.flush_cache(namespace=A) == 12
        await mem.check(idle=True)

    asyncio.run(run())
