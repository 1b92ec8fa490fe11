"""memsvc's ``commit`` and ``adopt`` (memsvc.adoption) through MemService.handle, in process.

A scheduler commits its requests' records; a successor presenting the dead
one's session id (same role and name, holding nothing) takes over its rows,
host entries and records, each row cut back to its committed KV. Bad input and
hostile adoptions get a clear error and change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from memsvc import protocol as p
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from tests.helpers import small_layout
from tests.service.test_handlers import Caller, ids

PAGE = 4


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=PAGE, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


def hello(service: MemService, name: str = "scheduler_svc", role: str = "scheduler") -> Caller:
    caller = Caller(service)
    reply = caller.ok("hello", role=role, lease_s=10.0, name=name)
    caller.session = reply["session"]
    return caller


def entries(*rows: tuple[int, int, int, int]) -> np.ndarray:
    return np.array([v for row in rows for v in row], dtype=np.int64)


def commit(caller: Caller, **fields) -> dict:
    arrays = {k: fields.pop(k) for k in ("entries", "token_ids") if k in fields}
    return caller.call("commit", arrays or None, **fields)


def state(service: MemService) -> tuple:
    """What an op that failed must not have changed."""
    pool = service.pool
    journals = {
        sid: {
            rid: (list(r.outputs), r.kv_committed, r.retractions, list(r.extras))
            for rid, r in j.records.items()
        }
        for sid, j in service.journals._by_session.items()
    }
    owners = {rid: s.sid for rid, s in service.sessions._owner_of.items()}
    return (
        journals,
        owners,
        sorted(s.sid for s in service.sessions.sessions()),
        pool.available_size(),
        {rid: pool.request(rid).kv_len for rid in pool.open_rids()},
        service._row_session.tolist(),
    )


def decoding(caller: Caller, rid: str, prompt: int, outputs: list[int], extra: int = 0) -> int:
    """Open ``rid`` with a prompt of ``prompt`` tokens and ``len(outputs)`` decoded ones
    plus ``extra`` slots in flight, committed up to ``outputs``; returns its row."""
    row = caller.ok("alloc_row", rid=rid)["row"]
    kv_len = prompt + len(outputs) - 1
    caller.ok("alloc_extend", {"num_tokens": ids(kv_len + extra)}, rids=[rid])
    reply = commit(
        caller,
        new_rids=[rid],
        new_meta=[b"meta-" + rid.encode()],
        new_prompt_lens=[prompt],
        rids=[rid],
        entries=entries((0, len(outputs), kv_len, 0)),
        token_ids=ids(*outputs),
    )
    assert reply["ok"], reply
    return row


def test_commit_appends_and_adopt_cuts_back_to_the_committed_kv(service) -> None:
    old = hello(service)
    row = decoding(old, "a", 6, [11, 12, 13], extra=5)  # steps in flight, slots reserved
    assert service.pool.request("a").kv_len == 6 + 3 - 1 + 5
    reply = commit(
        old, rids=["a"], entries=entries((3, 1, 0, 0)), token_ids=ids(14), ratio=0.5
    )  # a token whose KV row is not vouched for: kv_committed 0
    assert reply["ok"], reply
    # the last commit vouches for the row again
    reply = commit(old, rids=["a"], entries=entries((4, 0, 6 + 4 - 1, 0)), token_ids=ids())
    assert reply["ok"], reply
    available = service.pool.available_size()
    new = hello(service)
    got = new.ok("adopt", predecessor=old.session)
    (record,) = got["records"]
    assert record["rid"] == "a" and record["meta"] == b"meta-a"
    assert record["outputs"] == [11, 12, 13, 14]
    assert (record["kv"], record["row"], record["kv_len"]) == ("row", row, 9)
    assert got["ratio"] == 0.5 and got["freed_tokens"] == 0 and got["trimmed_tokens"] == 4
    assert service.pool.request("a").kv_len == 9
    assert service.pool.available_size() == available + PAGE  # the page of position 12 freed
    assert service.sessions.find(old.session) is None  # ended, nothing reclaimed
    # the successor owns the row: it decodes and releases it
    assert new.ok("decode_step", {"rows": ids(row)})["fits"]
    old_reply = old.call("decode_step", {"rows": ids(row)})
    assert old_reply["code"] == "unknown_session"
    new.ok("release", {"token_ids": ids(*range(11))}, rid="a", is_insert=False)
    new.ok("commit", drop=["a"])
    service.pool.check_integrity(idle=False)
    new.ok("goodbye")
    service.pool.check_integrity(idle=True)


def test_a_row_opened_again_after_the_commit_is_not_taken_for_written(service) -> None:
    """Retracted and re-admitted (a new row, its re-prefill in flight): freed, not run."""
    old = hello(service)
    decoding(old, "a", 6, [11, 12])
    old.ok("free_row", rid="a")  # retract (free)
    old.ok("alloc_row", rid="a")
    old.ok("alloc_extend", {"num_tokens": ids(8)}, rids=["a"])  # the re-prefill, in flight
    new = hello(service)
    got = new.ok("adopt", predecessor=old.session)
    (record,) = got["records"]
    assert (record["kv"], record["outputs"]) == ("none", [11, 12])
    assert got["freed_tokens"] == 8
    assert not service.pool.is_open("a")
    new.ok("goodbye")
    service.pool.check_integrity(idle=True)


def test_host_entries_and_unrecorded_rows(service) -> None:
    old = hello(service)
    decoding(old, "h", 5, [7, 8])  # 6 positions written
    old.ok("offload", rid="h")
    old.ok("free_row", rid="h")
    assert "h" in service.pool.host_store
    old.ok("alloc_row", rid="x")  # no record: its KV is freed
    old.ok("alloc_extend", {"num_tokens": ids(4)}, rids=["x"])
    new = hello(service)
    got = new.ok("adopt", predecessor=old.session)
    (record,) = got["records"]
    assert (record["kv"], record["kv_len"]) == ("host", 6)
    assert got["freed_tokens"] == 4 and not service.pool.is_open("x")
    new.ok("alloc_row", rid="h")  # the successor loads it back as the engine does
    assert new.ok("load", rid="h")["fits"]
    new.ok("goodbye")
    service.pool.check_integrity(idle=True)


@pytest.mark.parametrize(
    "fields, code",
    [
        (dict(rids=["zz"], entries=entries((0, 1, 0, 0)), token_ids=ids(5)), "invalid_argument"),
        (dict(rids=["a"], entries=entries((1, 1, 0, 0)), token_ids=ids(5)), "invalid_argument"),
        (dict(rids=["a"], entries=entries((2, 1, 99, 0)), token_ids=ids(5)), "invalid_argument"),
        (dict(rids=["a"], entries=entries((2, 1, 0, 0)), token_ids=ids(5, 6)), "invalid_argument"),
        (dict(rids=["a"], entries=ids(2, 1), token_ids=ids(5)), "bad_request"),
        (dict(new_rids=["a"], new_meta=[b""], new_prompt_lens=[3]), "invalid_argument"),
        (dict(new_rids=["n"], new_meta=[b""], new_prompt_lens=[0]), "invalid_argument"),
        (dict(new_rids=["n"], new_meta=[b""], new_prompt_lens=[]), "bad_request"),
        (dict(drop=["nope"]), "invalid_argument"),
        (
            dict(rids=["a", "a"], entries=entries((2, 0, 0, 0), (2, 0, 0, 0)), token_ids=ids()),
            "bad_request",
        ),
        (  # an extras chunk per rid, or none
            dict(rids=["a"], entries=entries((2, 0, 0, 0)), token_ids=ids(), extras=[b"x", b"y"]),
            "bad_request",
        ),
    ],
)
def test_bad_commits_change_nothing(service, fields, code) -> None:
    old = hello(service)
    decoding(old, "a", 6, [11, 12])
    before = state(service)
    reply = commit(old, **fields)
    assert not reply["ok"] and reply["message"], reply
    assert reply["code"] == code, reply
    assert state(service) == before


def test_extras_are_kept_in_order_and_counted_against_the_bound(service) -> None:
    """A logprob request's chunks: appended beside its tokens, given back by adopt."""
    old = hello(service)
    decoding(old, "a", 6, [11])
    decoding(old, "b", 5, [21])
    reply = commit(
        old,
        rids=["a", "b"],
        entries=entries((1, 1, 0, 0), (1, 1, 0, 0)),
        token_ids=ids(12, 22),
        extras=[b"a-1", b""],  # b has none this time
    )
    assert reply["ok"], reply
    assert commit(
        old, rids=["a"], entries=entries((2, 1, 0, 0)), token_ids=ids(13), extras=[b"a-2"]
    )["ok"]
    journal = service.journals.get(old.session)
    assert journal.nbytes == sum(r.nbytes for r in journal.records.values())
    service.journals.max_bytes = journal.nbytes + 10
    before = state(service)
    reply = commit(
        old, rids=["a"], entries=entries((3, 1, 0, 0)), token_ids=ids(14), extras=[b"z" * 11]
    )
    assert reply["code"] == "record_limit" and state(service) == before
    service.journals.max_bytes = 1 << 20
    new = hello(service)
    records = {r["rid"]: r for r in new.ok("adopt", predecessor=old.session)["records"]}
    assert records["a"]["extras"] == [b"a-1", b"a-2"] and records["b"]["extras"] == []
    new.ok("goodbye")  # (the last commits vouched for no row: adopt freed both)
    service.pool.check_integrity(idle=True)


def test_commit_bounds(service) -> None:
    service.journals.max_records = 2
    old = hello(service)
    old.ok("commit", new_rids=["a", "b"], new_meta=[b"", b""], new_prompt_lens=[1, 1])
    before = state(service)
    reply = old.call("commit", new_rids=["c"], new_meta=[b""], new_prompt_lens=[1])
    assert reply["code"] == "record_limit" and state(service) == before
    service.journals.max_bytes = 200
    reply = old.call("commit", new_rids=[], drop=["a"])
    assert reply["ok"]
    reply = old.call("commit", new_rids=["c"], new_meta=[b"x" * 200], new_prompt_lens=[1])
    assert reply["code"] == "record_limit"


def test_hostile_adoptions_are_refused_and_change_nothing(service) -> None:
    old = hello(service)
    decoding(old, "a", 6, [11, 12])
    other = hello(service, name="scheduler-p")  # another scheduler: another name
    worker = hello(service, role="worker")
    busy = hello(service)
    busy.ok("alloc_row", rid="mine")
    fresh = hello(service)
    before = state(service)
    for caller, predecessor in [
        (fresh, "0123456789abcdef"),  # a wrong id
        (fresh, fresh.session),  # itself
        (other, old.session),  # someone else's session, though it knows the id
        (worker, old.session),
        (busy, old.session),  # holds requests already
        (fresh, worker.session),  # not a scheduler of its kind
    ]:
        reply = caller.call("adopt", predecessor=predecessor)
        assert reply["code"] == "adopt_refused" and reply["message"], reply
        assert state(service) == before
    reply = fresh.call("adopt", predecessor="")
    assert reply["code"] == "bad_request" and state(service) == before
    # the rightful successor still can, once
    assert fresh.ok("adopt", predecessor=old.session)["records"]
    assert fresh.call("adopt", predecessor=old.session)["code"] == "adopt_refused"
    for caller in (fresh, other, worker, busy):
        caller.ok("goodbye")
    service.pool.check_integrity(idle=True)


def test_goodbye_and_expiry_drop_the_records(service) -> None:
    old = hello(service)
    decoding(old, "a", 6, [11, 12])
    reply = old.ok("goodbye")
    assert reply["reclaimed_tokens"] == 7
    assert service.journals.get(old.session) is None
    service.pool.check_integrity(idle=True)


def test_protocol_names_the_new_ops() -> None:
    assert {"commit", "adopt"} <= p.MUTATING_OPS


def test_an_expired_scheduler_session_with_records_is_kept_for_adoption(service) -> None:
    """Its restart may take longer than the lease: kept (answering only adopt and goodbye)
    for the adoption window, then reclaimed."""
    old = hello(service)
    decoding(old, "a", 6, [11, 12])
    worker = hello(service, role="worker")
    later = 11.0  # past both leases (10 s)
    assert service.expire_sessions(now=later) == [worker.session]  # no records: reclaimed
    assert service.sessions.find(old.session).orphaned_at == later
    old.now = later
    assert old.call("heartbeat")["code"] == "unknown_session"
    assert service.pool.is_open("a")
    new = hello(service)
    new.now = later
    assert new.ok("adopt", predecessor=old.session)["records"][0]["kv"] == "row"
    new.ok("goodbye")
    service.pool.check_integrity(idle=True)


def test_an_orphaned_session_is_reclaimed_after_the_window_or_on_goodbye(service) -> None:
    first, second = hello(service), hello(service)
    decoding(first, "a", 6, [11, 12])
    decoding(second, "b", 5, [7])
    assert service.expire_sessions(now=11.0) == []
    second.now = 12.0
    assert second.ok("goodbye")["reclaimed"] == ["b"]  # the stalled scheduler's recovery
    window = service.journals.window_s
    assert service.expire_sessions(now=11.0 + window - 1) == []
    assert service.expire_sessions(now=11.0 + window) == [first.session]
    assert len(service.sessions) == 0 and service.journals.get(first.session) is None
    service.pool.check_integrity(idle=True)
