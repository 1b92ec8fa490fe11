"""memsvc's per-session reply cache is bounded in bytes as well as count (issue 26, item 9).

At e09ed5e it kept the last 4,096 replies of each session whatever their size
(about 175 MB per session). The documented bound is 16 MiB per session
(``--reply-cache-bytes``): replies past it are forgotten oldest first, the
newest always kept (a retry of the last op must still be answered).
"""

from __future__ import annotations

import pytest

from memsvc.sessions import OpIdReusedError, SessionTable

DEFAULT_REPLY_CACHE_BYTES = 16 << 20  # as memsvc --help says
REPLY = 256 << 10


def _request(op_id: int) -> list[bytes]:
    """The request frames a reply is kept with (and a retry is compared to)."""
    return [op_id.to_bytes(8, "little")]


def test_replies_are_kept_within_the_byte_bound() -> None:
    table = SessionTable()
    session = table.open("scheduler", 60.0, "test", 0.0)
    for op_id in range(100):  # 25 MiB of replies
        table.remember_reply(session, op_id, _request(op_id), [bytes([op_id % 256]) * REPLY])
    kept = {}
    for op_id in range(100):
        reply = table.cached_reply(session, op_id, _request(op_id))
        if reply is not None:
            kept[op_id] = sum(map(len, reply))
    assert sum(kept.values()) <= DEFAULT_REPLY_CACHE_BYTES, f"{sum(kept.values())} bytes kept"
    assert 99 in kept and 0 not in kept  # the oldest go first
    assert list(kept) == list(range(min(kept), 100))


def test_the_newest_reply_is_kept_even_past_the_bound() -> None:
    table = SessionTable()
    session = table.open("scheduler", 60.0, "test", 0.0)
    huge = [b"x" * (DEFAULT_REPLY_CACHE_BYTES + 1)]
    table.remember_reply(session, 1, _request(1), [b"small"])
    table.remember_reply(session, 2, _request(2), huge)
    assert table.cached_reply(session, 2, _request(2)) == huge
    assert table.cached_reply(session, 1, _request(1)) is None


def test_the_bound_is_in_memsvcs_help() -> None:
    import memsvc.__main__ as memsvc_main

    text = memsvc_main.build_parser().format_help()
    assert "--reply-cache-bytes" in text


def test_the_requests_kept_with_the_replies_count_against_the_bound() -> None:
    """Issue 28, item 5: a reply is kept with its request's frames (compared on a retry,
    never hashed), so large requests with small replies are bounded too."""
    table = SessionTable()
    session = table.open("scheduler", 60.0, "test", 0.0)

    def request(op_id: int) -> list[bytes]:
        return [op_id.to_bytes(8, "little"), bytes(REPLY)]

    for op_id in range(100):  # 25 MiB of requests, a few bytes of replies
        table.remember_reply(session, op_id, request(op_id), [b"ok"])
    kept = [op_id for op_id in range(100) if table.cached_reply(session, op_id, request(op_id))]
    assert len(kept) * REPLY <= DEFAULT_REPLY_CACHE_BYTES and 99 in kept and 0 not in kept


def test_a_retry_must_resend_the_very_same_frames() -> None:
    table = SessionTable()
    session = table.open("scheduler", 60.0, "test", 0.0)
    table.remember_reply(session, 1, [b"header", b"\x01" * 64], [b"first reply"])
    assert table.cached_reply(session, 1, [b"header", b"\x01" * 64]) == [b"first reply"]
    for other in ([b"header", b"\x01" * 63 + b"\x02"], [b"header"], [b"header", b"\x01" * 65]):
        with pytest.raises(OpIdReusedError):
            table.cached_reply(session, 1, other)
