"""memsvc against hostile batches and replayed op ids (issue 18, defect 7), in process.

Each bad message gets a typed error, and the pool is as it was before it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from memsvc.transfer import TransferAgent
from tests.helpers import small_layout
from tests.service.test_handlers import Caller, ids


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20, max_message_bytes=1 << 20))
    finally:
        pool.close()


def _state(service: MemService) -> tuple[int, int, int]:
    pool = service.pool
    return pool.available_size(), pool.request("a").kv_len, pool.table.available_size()


@pytest.mark.parametrize(("op", "target"), [("decode_step", None), ("retract", "free")])
def test_more_rows_than_the_table_has_is_an_invalid_argument(service, op, target) -> None:
    c = Caller(service)
    c.hello()
    row = c.ok("alloc_row", rid="a")["row"]
    c.ok("alloc_extend", {"num_tokens": ids(6)}, rids=["a"])
    before = _state(service)
    rows = np.full(service.pool.table.num_rows * 2, row, dtype=np.int64)
    fields = {} if target is None else {"targets": [target] * rows.size}
    reply = c.call(op, {"rows": rows}, **fields)
    assert reply["ok"] is False and reply["code"] == "invalid_argument", reply
    assert "twice" in reply["message"]
    assert _state(service) == before
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_a_replayed_op_id_with_another_body_is_refused(service) -> None:
    c = Caller(service)
    c.hello()
    first = c.call("alloc_row", op_id=500, rid="a")
    assert first["ok"]
    c.ok("alloc_extend", {"num_tokens": ids(6)}, rids=["a"])
    before = _state(service)
    other = c.call("alloc_row", op_id=500, rid="b")
    assert other["ok"] is False and other["code"] == "op_id_reused", other
    assert "500" in other["message"]
    arrays = c.call("alloc_extend", {"num_tokens": ids(4)}, op_id=501, rids=["a"])
    assert arrays["ok"]
    after_extend = _state(service)
    changed = c.call("alloc_extend", {"num_tokens": ids(8)}, op_id=501, rids=["a"])
    assert changed["ok"] is False and changed["code"] == "op_id_reused", changed
    assert _state(service) == after_extend != before
    assert not service.pool.is_open("b")
    # The same body again is a retry: its first reply, nothing done twice.
    again = c.call("alloc_row", op_id=500, rid="a")
    assert again == first
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def _victim_holding_a_locked_prefix(c: Caller, tokens: np.ndarray) -> np.ndarray:
    """Cache ``tokens``, then run a request that holds ``tokens[:8]`` locked; its slots."""
    c.ok("alloc_row", rid="v0")
    c.ok("alloc_extend", {"num_tokens": ids(tokens.size)}, rids=["v0"])
    c.ok("release", {"token_ids": tokens}, rid="v0", is_insert=True)
    c.ok("alloc_row", rid="v1")
    assert c.ok("match_prefix", {"token_ids": tokens[:9]}, rid="v1")["prefix_len"] == 8
    c.ok("alloc_extend", {"num_tokens": ids(1)}, rids=["v1"])
    return c.service.pool.slots("v1").copy()


def _pool_state(service: MemService) -> tuple:
    pool = service.pool
    return (
        pool.available_size(),
        pool.evictable_size(),
        pool.protected_size(),
        tuple(pool.allocator.owners().tolist()),
        tuple(sorted((rid, pool.request(rid).kv_len) for rid in pool.open_rids())),
    )


@pytest.mark.parametrize("op", ["release", "cache_unfinished"])
def test_forged_token_ids_for_a_locked_prefix_are_refused(service, op) -> None:
    """Issue 18, defect 1: B hands back T's locked pages under other token ids."""
    victim, bob = Caller(service), Caller(service)
    victim.hello()
    bob.hello()
    tokens = np.arange(1, 17, dtype=np.int64)  # T: four pages
    victim_slots = _victim_holding_a_locked_prefix(victim, tokens)
    bob.ok("alloc_row", rid="x")
    assert bob.ok("match_prefix", {"token_ids": tokens[:-1]}, rid="x")["prefix_len"] == 12
    bob.ok("alloc_extend", {"num_tokens": ids(4)}, rids=["x"])
    before = _pool_state(service)
    fields = {"rid": "x", "is_insert": True} if op == "release" else {"rid": "x"}
    reply = bob.call(op, {"token_ids": np.arange(100, 116)}, **fields)
    assert reply["ok"] is False and reply["code"] == "invalid_argument", reply
    assert "locked prefix" in reply["message"]
    assert _pool_state(service) == before
    bob.ok("check")
    # B's next allocations never reach the victim's pages.
    bob.ok("release", {"token_ids": tokens}, rid="x", is_insert=True)
    bob.ok("alloc_row", rid="y")
    grabbed = bob.ok("alloc_extend", {"num_tokens": ids(service.pool.capacity - 16)}, rids=["y"])
    assert grabbed["fits"]
    ps = service.pool.page_size
    assert not set((grabbed["slots"] // ps).tolist()) & set((victim_slots // ps).tolist())
    np.testing.assert_array_equal(service.pool.slots("v1"), victim_slots)
    bob.ok("free_row", rid="y")
    victim.ok("release", {"token_ids": tokens[:9]}, rid="v1", is_insert=True)
    victim.ok("check", idle=True)


def test_a_decode_room_never_receives_into_the_trees_pages(service) -> None:
    """Issue 18, defect 1, the PD path: a room's pages are written by the peer, so
    a request holding a cached prefix (pages shared with other sessions) cannot expect one."""
    service.transfer = TransferAgent(
        service.pool, role="decode", backend="zmq", epoch="e", listen="ipc://unused"
    )
    victim, bob = Caller(service), Caller(service)
    victim.hello()
    bob.hello()
    tokens = np.arange(1, 17, dtype=np.int64)
    _victim_holding_a_locked_prefix(victim, tokens)
    bob.ok("alloc_row", rid="x")
    assert bob.ok("match_prefix", {"token_ids": tokens[:-1]}, rid="x")["prefix_len"] == 12
    bob.ok("alloc_extend", {"num_tokens": ids(4)}, rids=["x"])
    before = _pool_state(service)
    reply = bob.call("pd_expect", rid="x", room=5)
    assert reply["ok"] is False and reply["code"] == "invalid_argument", reply
    assert "prefix" in reply["message"]
    assert service.transfer.room(5) is None and _pool_state(service) == before
    bob.ok("free_row", rid="x")
    victim.ok("free_row", rid="v1")
    victim.ok("check", idle=True)


def test_sessions_and_their_leases_are_capped() -> None:
    """Issue 18, defect 5: 3,000 hellos with hour-long leases were all accepted."""
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    with KVPool(layout) as pool:
        service = MemService(pool, ServiceConfig())  # the defaults memsvc runs with
        callers = []
        for _ in range(3000):
            caller = Caller(service)
            reply = caller.call("hello", role="scheduler", lease_s=10.0)
            if not reply["ok"]:
                break
            caller.session = reply["session"]
            callers.append(caller)
        assert reply["ok"] is False and reply["code"] == "too_many_sessions", reply
        assert len(callers) == len(service.sessions) == service.config.max_sessions
        assert str(service.config.max_sessions) in reply["message"]
        callers.pop().ok("goodbye")
        Caller(service).hello()  # room again
        long = Caller(service).call("hello", role="scheduler", lease_s=3600.0)
        assert long["ok"] is False and long["code"] == "invalid_argument", long
        assert "lease" in long["message"] and len(service.sessions) == service.config.max_sessions
        callers[0].ok("check", idle=True)
