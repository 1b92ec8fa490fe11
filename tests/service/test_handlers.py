"""MemService.handle in process: every op, sessions, leases, idempotency, ownership, bad input."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from memsvc import protocol as p
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from tests.helpers import small_layout


class Caller:
    """Builds frames like the client does and decodes replies."""

    def __init__(self, service: MemService) -> None:
        self.service = service
        self.session: str | None = None
        self.op_id = 0
        self.now = 0.0

    def raw(self, frames: list[bytes]) -> dict:
        return p.unpack(self.service.handle(frames, now=self.now))

    def call(self, op: str, arrays: dict | None = None, op_id: int | None = None, **fields) -> dict:
        if op_id is None:
            self.op_id += 1
            op_id = self.op_id
        header = {"op": op, "op_id": op_id, "session": self.session, **fields}
        return self.raw(p.pack(header, arrays))

    def ok(self, op: str, arrays: dict | None = None, **fields) -> dict:
        reply = self.call(op, arrays, **fields)
        assert reply["ok"], reply
        return reply

    def hello(self, role: str = "scheduler", lease_s: float = 10.0) -> dict:
        reply = self.ok("hello", role=role, lease_s=lease_s)
        self.session = reply["session"]
        return reply


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20, max_message_bytes=4096))
    finally:
        pool.close()


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_every_op_and_sizes_in_every_reply(service) -> None:
    c = Caller(service)
    hello = c.hello()
    assert hello["layout"] == service.pool.layout.to_dict()
    assert hello["handle"]["backend"] == "shm" and hello["capacity"] == 64
    row = c.ok("alloc_row", rid="a")["row"]
    assert c.ok("match_prefix", {"token_ids": ids(1, 2, 3)}, rid="a")["prefix_len"] == 0
    reply = c.ok("alloc_extend", {"num_tokens": ids(9)}, rids=["a"])
    assert reply["fits"] and reply["slots"].size == 9
    assert reply["available"] == 64 - 12 and reply["evictable"] == 0
    assert reply["epoch"] == service.epoch
    step = c.ok("decode_step", {"rows": ids(row)})
    assert step["fits"] and step["slots"].tolist() == [int(reply["slots"][-1]) + 1]
    assert c.ok("cache_unfinished", {"token_ids": np.arange(10)}, rid="a")["prefix_len"] == 8
    assert c.ok("offload", rid="a")["bytes"] == 3 * service.pool.layout.bytes_per_page
    c.ok("free_row", rid="a")
    assert c.ok("stats")["host_store_entries"] == 1
    c.ok("alloc_row", rid="a")
    loaded = c.ok("load", rid="a")
    assert loaded["fits"] and loaded["slots"].size == 10
    c.ok("release", {"token_ids": np.arange(10)}, rid="a", is_insert=True)
    c.ok("check", idle=True)
    c.ok("heartbeat")
    assert c.ok("goodbye")["reclaimed"] == []
    service.pool.check_integrity(idle=True)


def test_decode_step_reports_missing_without_changing_anything(service) -> None:
    c = Caller(service)
    c.hello()
    rows = [c.ok("alloc_row", rid=r)["row"] for r in ("a", "b")]
    c.ok("alloc_extend", {"num_tokens": ids(32, 32)}, rids=["a", "b"])  # the whole pool
    before = service.pool.available_size()
    reply = c.ok("decode_step", {"rows": ids(*rows)})
    assert reply == {**reply, "fits": False, "missing": 8}
    assert service.pool.available_size() == before
    retract = c.ok("retract", {"rows": ids(*rows)}, targets=["free", "free"])
    assert retract["retracted"] == ["b"] and not retract["last_does_not_fit"]
    assert retract["tokens_gained"] == 32
    assert c.ok("decode_step", {"rows": ids(rows[0])})["fits"]
    c.ok("free_row", rid="a")
    with pytest.raises(AssertionError):
        c.ok("free_row", rid="b")  # retracted requests are closed
    c.ok("check", idle=True)


def test_retried_op_is_answered_from_cache_not_redone(service) -> None:
    c = Caller(service)
    c.hello()
    c.ok("alloc_row", rid="a")
    first = c.call("alloc_extend", {"num_tokens": ids(4)}, op_id=77, rids=["a"])
    again = c.call("alloc_extend", {"num_tokens": ids(4)}, op_id=77, rids=["a"])
    assert first["slots"].tolist() == again["slots"].tolist()
    assert service.pool.request("a").kv_len == 4  # applied once
    # an error reply is remembered too: a retry of a failed op fails the same way
    bad = c.call("free_row", op_id=78, rid="nope")
    assert c.call("free_row", op_id=78, rid="nope") == bad
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_ownership_between_sessions(service) -> None:
    alice, bob = Caller(service), Caller(service)
    alice.hello()
    bob.hello()
    row = alice.ok("alloc_row", rid="a")["row"]
    alice.ok("alloc_extend", {"num_tokens": ids(4)}, rids=["a"])
    for op, arrays, fields in [
        ("alloc_row", None, {"rid": "a"}),
        ("free_row", None, {"rid": "a"}),
        ("release", None, {"rid": "a", "is_insert": False}),
        ("offload", None, {"rid": "a"}),
        ("decode_step", {"rows": ids(row)}, {}),
        ("retract", {"rows": ids(row)}, {"targets": ["free"]}),
    ]:
        reply = bob.call(op, arrays, **fields)
        assert not reply["ok"] and reply["code"] == "not_owner", reply
    assert service.pool.request("a").kv_len == 4
    alice.ok("free_row", rid="a")
    alice.ok("check", idle=True)


def test_lease_expiry_reclaims_rows_pages_locks_and_host_entries(service) -> None:
    c = Caller(service)
    c.hello(lease_s=5.0)
    c.ok("alloc_row", rid="kept")
    c.ok("alloc_extend", {"num_tokens": ids(8)}, rids=["kept"])
    c.ok("cache_unfinished", {"token_ids": np.arange(8)}, rid="kept")  # holds a tree lock
    c.ok("alloc_row", rid="parked")
    c.ok("alloc_extend", {"num_tokens": ids(5)}, rids=["parked"])
    c.ok("offload", rid="parked")
    c.ok("free_row", rid="parked")
    assert service.pool.protected_size() == 8 and len(service.pool.host_store) == 1
    c.now = 4.0
    assert service.expire_sessions(now=4.0) == []
    c.ok("heartbeat")  # renews to 4.0 + 5.0
    assert service.expire_sessions(now=8.9) == []
    assert service.expire_sessions(now=9.1) == [c.session]
    service.pool.check_integrity(idle=True)
    c.now = 9.2
    reply = c.call("heartbeat")
    assert not reply["ok"] and reply["code"] == "unknown_session"


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xc1"], "malformed"),
        ([msgpack.packb([1, 2])], "malformed"),
        ([msgpack.packb({"op": "warp", "op_id": 1})], "unknown_op"),
        ([msgpack.packb({"op_id": 1})], "unknown_op"),
        ([msgpack.packb({"op": "alloc_row", "op_id": "x", "rid": "a"})], "bad_request"),
        ([msgpack.packb({"op": "alloc_row", "op_id": 1, "rid": ""})], "bad_request"),
        ([msgpack.packb({"op": "alloc_row", "op_id": 1, "rid": "a", "evil": 1})], "bad_request"),
        ([msgpack.packb({"op": "decode_step", "op_id": 1, "rows": [1, 2]})], "bad_request"),
        ([msgpack.packb({"op": "decode_step", "op_id": 1, "arrays": ["rows"]})], "malformed"),
        (
            [msgpack.packb({"op": "decode_step", "op_id": 1, "arrays": ["rows"]}), b"abc"],
            "malformed",
        ),
        ([msgpack.packb({"op": "heartbeat", "op_id": 1}), b"x" * 5000], "too_large"),
        ([msgpack.packb({"op": "heartbeat", "op_id": 1, "session": "nobody"})], "unknown_session"),
    ],
)
def test_bad_input_gets_a_coded_error_and_changes_nothing(service, frames, code) -> None:
    c = Caller(service)
    c.hello()
    c.ok("alloc_row", rid="a")
    c.ok("alloc_extend", {"num_tokens": ids(6)}, rids=["a"])
    before = (service.pool.available_size(), service.pool.request("a").kv_len)
    reply = c.raw(frames)
    assert reply["ok"] is False and reply["code"] == code, reply
    assert reply["message"]
    assert (service.pool.available_size(), service.pool.request("a").kv_len) == before
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


@pytest.mark.parametrize(
    ("op", "arrays", "fields", "code"),
    [
        ("alloc_extend", {"num_tokens": ids(-1)}, {"rids": ["a"]}, "invalid_argument"),
        ("alloc_extend", {"num_tokens": ids(1, 2)}, {"rids": ["a"]}, "invalid_argument"),
        ("alloc_extend", {"num_tokens": ids(10_000)}, {"rids": ["a"]}, "invalid_argument"),
        ("decode_step", {"rows": ids(99)}, {}, "unknown_request"),
        ("decode_step", {"rows": ids(-3)}, {}, "unknown_request"),
        ("decode_step", {"rows": ids(1, 1)}, {}, "invalid_argument"),
        ("match_prefix", {"token_ids": ids(1)}, {"rid": "a"}, "invalid_argument"),  # holds KV
        ("release", None, {"rid": "a", "is_insert": True}, "invalid_argument"),  # no tokens
        ("load", None, {"rid": "a"}, "unknown_request"),
        ("host_discard", None, {"rid": "a"}, "unknown_request"),
        ("offload", None, {"rid": "a", "num_tokens": 50}, "invalid_argument"),
        ("free_row", None, {"rid": "ghost"}, "unknown_request"),
        ("alloc_row", None, {"rid": "a"}, "duplicate_request"),
        ("retract", {"rows": ids(1)}, {"targets": ["teleport"]}, "bad_request"),
        ("retract", {"rows": ids(1, 2)}, {"targets": ["free"]}, "bad_request"),  # one short
    ],
)
def test_out_of_range_values_get_typed_errors(service, op, arrays, fields, code) -> None:
    c = Caller(service)
    c.hello()
    c.ok("alloc_row", rid="a")
    c.ok("alloc_extend", {"num_tokens": ids(6)}, rids=["a"])
    before = (service.pool.available_size(), service.pool.request("a").kv_len)
    reply = c.call(op, arrays, **fields)
    assert reply["ok"] is False and reply["code"] == code, reply
    assert (service.pool.available_size(), service.pool.request("a").kv_len) == before
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_rows_run_out_gives_an_error_not_a_crash(service) -> None:
    c = Caller(service)
    c.hello()
    for i in range(4):
        c.ok("alloc_row", rid=f"r{i}")
    reply = c.call("alloc_row", rid="r4")
    assert reply["code"] == "out_of_rows"
    assert c.ok("goodbye")["reclaimed"] == ["r0", "r1", "r2", "r3"]
    service.pool.check_integrity(idle=True)


def test_async_offload_pending_pages_in_stats_and_load_waits_for_the_copy() -> None:
    """With asynchronous offload a retract's victim pages show as pending (and
    available) until the copy ends; a load of the victim waits for it."""
    from tests.core.test_async_offload import gate_copies

    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes, async_offload=True)
    try:
        gate = gate_copies(pool)
        c = Caller(MemService(pool, ServiceConfig(retract_decode_steps=20)))
        c.hello()
        rows = [c.ok("alloc_row", rid=rid)["row"] for rid in ("keep", "victim")]
        c.ok("alloc_extend", {"num_tokens": ids(8, 24)}, rids=["keep", "victim"])
        data = np.random.default_rng(0).standard_normal((24, 2, 2, 2, 8)).astype(np.float16)
        pool.buffers.write_slots(pool.slots("victim"), data)
        retract = c.ok("retract", {"rows": ids(*rows)}, targets=["host_entry"] * 2)
        assert retract["retracted"] == ["victim"]
        stats = c.ok("stats")
        assert stats["pending_pages"] == 6 and stats["available"] == 64 - 8
        assert stats["counters"]["offload_bytes"] == 6 * layout.bytes_per_page
        gate.set()
        c.ok("alloc_row", rid="victim")
        loaded = c.ok("load", rid="victim")
        assert pool.buffers.read_slots(loaded["slots"]).tobytes() == data.tobytes()
        for rid in ("keep", "victim"):
            c.ok("release", rid=rid, is_insert=False)
        pool.settle_copies()
        assert c.ok("stats")["pending_pages"] == 0
        c.ok("check", idle=True)
    finally:
        pool.close()
