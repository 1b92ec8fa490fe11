"""The batched ops in process: ``admit``, ``alloc_extend``'s ``free_rids``,
``cache_unfinished_many`` and ``release_many``; what they answer, and that bad or
hostile batches get an error and change nothing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.errors import InvalidArgumentError
from memsvc.handlers import MemService, ServiceConfig
from memsvc.handlers_batch import ADMIT_COLUMNS
from tests.helpers import small_layout
from tests.service.test_handlers import Caller, ids

PROMPT = np.arange(100, 113, dtype=np.int64)  # 13 tokens: 3 pages cached


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


def batch(items: list[tuple[str, np.ndarray]]) -> tuple[list[str], dict[str, np.ndarray]]:
    parts = [np.asarray(tokens, dtype=np.int64) for _, tokens in items]
    arrays = {
        "token_ids": np.concatenate(parts) if parts else ids(),
        "token_lens": ids(*[part.size for part in parts]),
    }
    return [rid for rid, _ in items], arrays


def admit(c: Caller, items: list[tuple[str, np.ndarray]], **fields) -> dict:
    rids, arrays = batch(items)
    return c.call("admit", arrays, rids=rids, **fields)


def matches(reply: dict) -> list[dict[str, int]]:
    rows = reply["matches"].reshape(-1, len(ADMIT_COLUMNS)).tolist()
    return [dict(zip(ADMIT_COLUMNS, row, strict=True)) for row in rows]


def two_sessions(service: MemService) -> tuple[Caller, Caller]:
    """Ours, and another session that holds the request ``theirs``."""
    c, other = Caller(service), Caller(service)
    c.hello()
    other.hello()
    other.ok("alloc_row", rid="theirs")
    return c, other


def cache_prompt(c: Caller) -> None:
    """PROMPT's first 12 tokens go into the tree (evictable, unlocked)."""
    c.ok("alloc_row", rid="w")
    c.ok("alloc_extend", {"num_tokens": ids(13)}, rids=["w"])
    c.ok("release", {"token_ids": PROMPT}, rid="w", is_insert=True)


def test_admit_is_alloc_row_and_match_prefix_for_each_with_what_each_lock_pinned(service):
    c = Caller(service)
    c.hello()
    cache_prompt(c)
    assert service.pool.evictable_size() == 12
    reply = admit(c, [("a", PROMPT[:12]), ("b", PROMPT[:12]), ("c", ids(7, 8, 9, 10, 11))])
    assert reply["ok"] and not reply["out_of_rows"], reply
    got = matches(reply)
    assert [m["prefix_len"] for m in got] == [12, 12, 4 * 0]
    assert [m["device_hit"] for m in got] == [12, 12, 0]
    assert [m["host_hit"] + m["storage_hit"] + m["load_pending"] for m in got] == [0, 0, 0]
    # a's lock took the 12 evictable tokens; b's found them locked already
    assert [m["pinned"] for m in got] == [12, 0, 0]
    assert reply["before"][:2] == [64 - 12, 12]  # available, evictable before any of it
    assert [m["row"] for m in got] == [service.pool.request(r).row for r in "abc"]
    assert service.pool.evictable_size() == 0 and service.pool.protected_size() == 12
    # the round's second trip: a is extended, b and c (not admitted) are closed first
    reply = c.ok("alloc_extend", {"num_tokens": ids(1)}, rids=["a"], free_rids=["b", "c"])
    assert reply["fits"] and reply["slots"].size == 1
    assert not service.pool.is_open("b") and not service.pool.is_open("c")
    assert service.pool.request("a").kv_len == 13
    other = Caller(service)
    other.hello()
    other.ok("alloc_row", rid="b")  # b is nobody's now
    other.ok("free_row", rid="b")
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_admit_stops_at_the_first_candidate_without_a_row(service):
    c = Caller(service)
    c.hello()
    c.ok("alloc_row", rid="x")
    free_rows = service.pool.table.available_size()
    rids = [f"r{i}" for i in range(free_rows + 2)]
    reply = admit(c, [(rid, ids(1, 2, 3)) for rid in rids])
    assert reply["ok"] and reply["out_of_rows"]
    assert len(matches(reply)) == free_rows
    assert [service.pool.is_open(r) for r in rids] == [True] * free_rows + [False, False]
    c.ok("alloc_extend", {"num_tokens": ids()}, rids=[], free_rids=["x", *rids[:free_rows]])
    c.ok("check", idle=True)


def test_a_bad_admit_opens_nothing(service):
    c, other = two_sessions(service)
    c.ok("alloc_row", rid="open")
    cache_prompt(c)
    too_long = np.zeros(service.pool.table.max_context_len + 1, dtype=np.int64)
    for items, code in [
        ([("a", PROMPT[:12]), ("open", ids(1))], "duplicate_request"),
        ([("a", PROMPT[:12]), ("b", too_long)], "invalid_argument"),
        ([("a", PROMPT[:12]), ("a", ids(1))], "bad_request"),
    ]:
        reply = admit(c, items)
        assert not reply["ok"] and reply["code"] == code, (items, reply)
        assert not service.pool.is_open("a") and service.pool.evictable_size() == 12
    rids, arrays = batch([("a", PROMPT[:12])])
    arrays["token_lens"] = ids(11)  # lengths that do not add up
    reply = c.call("admit", arrays, rids=rids)
    assert not reply["ok"] and reply["code"] == "bad_request"
    assert not service.pool.is_open("a")
    other.ok("free_row", rid="theirs")
    c.ok("free_row", rid="open")
    c.ok("check", idle=True)


def test_admit_stops_before_a_candidate_of_another_session(service):
    """As alloc_row would have refused it there: the candidates before it are opened, it
    and the rest are not touched, and the reply names it."""
    c, other = two_sessions(service)
    reply = admit(c, [("a", ids(1)), ("theirs", ids(2)), ("b", ids(3))])
    assert reply["ok"] and reply["not_owner"] == "theirs" and not reply["out_of_rows"]
    assert len(matches(reply)) == 1 and service.pool.is_open("a")
    assert not service.pool.is_open("b")
    reply = admit(c, [("theirs", ids(2))])
    assert reply["ok"] and reply["not_owner"] == "theirs" and not len(matches(reply))
    other.ok("free_row", rid="theirs")
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_a_match_failing_mid_batch_closes_what_the_message_opened(service, monkeypatch):
    c = Caller(service)
    c.hello()
    cache_prompt(c)
    real = service.pool.match_prefix_tiers

    def fail_for_b(rid, tokens):
        if rid == "b":
            raise InvalidArgumentError("b cannot be matched")
        return real(rid, tokens)

    monkeypatch.setattr(service.pool, "match_prefix_tiers", fail_for_b)
    reply = admit(c, [("a", PROMPT[:12]), ("b", PROMPT[:12]), ("c", ids(1))])
    assert not reply["ok"] and reply["code"] == "invalid_argument"
    assert not any(service.pool.is_open(r) for r in "abc")
    assert service.pool.evictable_size() == 12 and service.pool.protected_size() == 0
    monkeypatch.undo()
    other = Caller(service)
    other.hello()
    other.ok("alloc_row", rid="a")  # a's claim went with it
    other.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_a_retried_admit_is_answered_from_cache_not_redone(service):
    c = Caller(service)
    c.hello()
    first = admit(c, [("a", ids(1, 2, 3))], op_id=50)
    again = admit(c, [("a", ids(1, 2, 3))], op_id=50)
    assert first["ok"] and again["ok"]
    assert first["matches"].tolist() == again["matches"].tolist()
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_alloc_extend_frees_the_rejected_even_when_it_does_not_fit(service):
    c = Caller(service)
    c.hello()
    cache_prompt(c)
    assert admit(c, [("a", ids(1)), ("b", PROMPT[:12])])["ok"]
    assert service.pool.protected_size() == 12
    reply = c.ok("alloc_extend", {"num_tokens": ids(65)}, rids=["a"], free_rids=["b"])
    assert not reply["fits"]
    assert not service.pool.is_open("b") and service.pool.protected_size() == 0  # unlocked
    assert service.pool.request("a").kv_len == 0
    c.ok("free_row", rid="a")
    c.ok("check", idle=True)


def test_a_bad_alloc_extend_frees_nothing(service):
    c, other = two_sessions(service)
    assert admit(c, [("a", ids(1)), ("b", ids(2))])["ok"]
    for counts, free, code in [
        (ids(4), ["b", "theirs"], "not_owner"),
        (ids(4), ["b", "nope"], "unknown_request"),
        (ids(4), ["b", "a"], "bad_request"),  # extended and freed
        (ids(4), ["b", "b"], "bad_request"),
        (ids(-1), ["b"], "invalid_argument"),
    ]:
        reply = c.call("alloc_extend", {"num_tokens": counts}, rids=["a"], free_rids=free)
        assert not reply["ok"] and reply["code"] == code, (free, reply)
        assert service.pool.is_open("b") and service.pool.is_open("theirs")
        assert service.pool.request("a").kv_len == 0
    c.ok("alloc_extend", {"num_tokens": ids()}, rids=[], free_rids=["a", "b"])
    other.ok("free_row", rid="theirs")
    c.ok("check", idle=True)


def test_cache_unfinished_many_publishes_each_or_nothing(service):
    c = Caller(service)
    c.hello()
    assert admit(c, [("a", ids()), ("b", ids())])["ok"]
    c.ok("alloc_extend", {"num_tokens": ids(9, 5)}, rids=["a", "b"])
    tokens_a, tokens_b = np.arange(9), np.arange(50, 55)
    rids, arrays = batch([("a", tokens_a), ("b", tokens_b[:3])])
    reply = c.call("cache_unfinished_many", arrays, rids=rids)  # b's length is wrong
    assert not reply["ok"] and reply["code"] == "invalid_argument"
    assert service.pool.protected_size() == 0  # a was not published either
    rids, arrays = batch([("a", tokens_a), ("b", tokens_b)])
    reply = c.ok("cache_unfinished_many", arrays, rids=rids)
    assert reply["prefix_lens"].tolist() == [8, 4]
    assert service.pool.protected_size() == 12
    rids, arrays = batch([("a", tokens_a), ("b", tokens_b)])
    c.ok("release_many", arrays, rids=rids, is_insert=[True, False])
    assert service.pool.evictable_size() == 12
    c.ok("check", idle=True)


def test_release_many_checks_every_rid_first(service):
    c, other = two_sessions(service)
    assert admit(c, [("a", ids()), ("b", ids())])["ok"]
    c.ok("alloc_extend", {"num_tokens": ids(8, 8)}, rids=["a", "b"])
    for rids, code in [
        (["a", "theirs"], "not_owner"),
        (["a", "nope"], "unknown_request"),
        (["a", "a"], "bad_request"),
    ]:
        _, arrays = batch([(rid, np.arange(8)) for rid in rids])
        reply = c.call("release_many", arrays, rids=rids, is_insert=[True] * len(rids))
        assert not reply["ok"] and reply["code"] == code, (rids, reply)
        assert service.pool.is_open("a") and service.pool.is_open("theirs")
    _, arrays = batch([("a", np.arange(8))])
    reply = c.call("release_many", arrays, rids=["a"], is_insert=[True, False])
    assert not reply["ok"] and reply["code"] == "bad_request"  # a flag per rid
    rids, arrays = batch([("a", np.arange(8)), ("b", np.arange(5))])  # b's ids too few
    reply = c.call("release_many", arrays, rids=rids, is_insert=[True, True])
    assert not reply["ok"] and reply["code"] == "invalid_argument"
    assert service.pool.is_open("a") and service.pool.evictable_size() == 0
    rids, arrays = batch([("a", np.arange(8)), ("b", np.arange(20, 28))])
    c.ok("release_many", arrays, rids=rids, is_insert=[True, True])
    assert service.pool.evictable_size() == 16
    assert not service.pool.is_open("a") and not service.pool.is_open("b")
    other.ok("free_row", rid="theirs")
    c.ok("check", idle=True)


def test_admit_with_the_hierarchy_counts_the_loaded_pages_as_pinned(tmp_path):
    """A host hit is loaded into fresh device pages: they leave available, and ``pinned``
    counts them, as the scheduler's two reads around a lone match did."""
    from memsvc.core.hicache import HiCacheConfig

    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    hicache = HiCacheConfig(size_bytes=8 * layout.bytes_per_page)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes, hicache=hicache)
    service = MemService(pool, ServiceConfig(retract_decode_steps=4))
    try:
        c = Caller(service)
        c.hello()
        cache_prompt(c)
        c.ok("flush_cache", device_only=True)  # device -> host
        assert pool.evictable_size() == 0
        available = pool.available_size()
        reply = admit(c, [("a", PROMPT[:12]), ("b", PROMPT[:12])])
        assert reply["ok"], reply
        a, b = matches(reply)
        assert (a["prefix_len"], a["device_hit"], a["host_hit"]) == (12, 0, 12)
        assert a["pinned"] == 12 and reply["before"][0] == available
        assert (b["prefix_len"], b["device_hit"], b["pinned"]) == (12, 12, 0)
        assert pool.available_size() == available - 12
        reply = c.ok("alloc_extend", {"num_tokens": ids(1)}, rids=["a"], free_rids=["b"])
        assert reply["fits"]
        c.ok("free_row", rid="a")
        c.ok("check", idle=True)
    finally:
        pool.close()
