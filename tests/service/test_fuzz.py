"""Fuzzing memsvc's edge: random and mutated messages get replies and never corrupt state."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsvc import protocol as p
from memsvc.client import MemClient
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from tests.helpers import small_layout

OPS = [*p.OP_NAMES, "nope"]
FIELDS = [
    "op",
    "op_id",
    "session",
    "rid",
    "rids",
    "role",
    "lease_s",
    "token_ids",
    "num_tokens",
    "rows",
    "mode",
    "is_insert",
    "num_tokens",
    "idle",
    "arrays",
    "name",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from([*OPS, "r0", "r1", "offload"]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def valid_messages(session: str) -> list[list[bytes]]:
    arr = np.array
    return [
        p.pack({"op": "alloc_row", "op_id": 1, "session": session, "rid": "r0"}),
        p.pack(
            {"op": "alloc_extend", "op_id": 2, "session": session, "rids": ["r0"]},
            {"num_tokens": arr([5])},
        ),
        p.pack({"op": "decode_step", "op_id": 3, "session": session}, {"rows": arr([1, 2])}),
        p.pack(
            {"op": "release", "op_id": 4, "session": session, "rid": "r0", "is_insert": True},
            {"token_ids": arr([1, 2, 3, 4, 5])},
        ),
        p.pack(
            {"op": "retract", "op_id": 5, "session": session, "targets": ["host_entry"] * 2},
            {"rows": arr([2, 1])},
        ),
        p.pack(
            {"op": "match_prefix", "op_id": 6, "session": session, "rid": "r1"},
            {"token_ids": arr([1, 2, 3, 4])},
        ),
    ]


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = list(frames)
    kind = rng.randrange(6)
    i = rng.randrange(len(frames))
    if kind == 0 and frames[i]:  # flip bytes
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        frames[i] = bytes(data)
    elif kind == 1:  # truncate
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == 2:  # duplicate or drop a frame
        frames.insert(i, frames[i]) if rng.random() < 0.5 else frames.pop(i)
    elif kind == 3:  # random extra frame
        frames.append(rng.randbytes(rng.randrange(0, 24)))
    elif kind == 4:  # swap frames
        j = rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    return frames or [b""]


def fresh_service() -> tuple[MemService, str]:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4, max_context_len=64)
    pool = KVPool(layout, host_store_bytes=8 * layout.bytes_per_page)
    service = MemService(pool, ServiceConfig(max_message_bytes=1 << 16))
    hello = p.unpack(service.handle(p.pack({"op": "hello", "op_id": 0, "role": "scheduler"})))
    return service, hello["session"]


def finish(service: MemService, session: str) -> None:
    service.pool.check_integrity()
    bye = p.unpack(service.handle(p.pack({"op": "goodbye", "op_id": 10**9, "session": session})))
    assert bye["ok"], bye
    for other in list(service.sessions.sessions()):
        service.reclaim(other)
    service.pool.check_integrity(idle=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(
        st.one_of(
            st.lists(st.binary(max_size=40), min_size=1, max_size=3),
            st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
            st.tuples(st.integers(0, 5), st.randoms(use_true_random=False)),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_random_and_mutated_messages_in_process(messages) -> None:
    service, session = fresh_service()
    try:
        for message in messages:
            if isinstance(message, dict):
                message = {**message, "session": session} if "op" in message else message
                frames = [msgpack.packb(message, use_bin_type=True)]
            elif isinstance(message, tuple):
                index, rng = message
                frames = mutate(valid_messages(session)[index], rng)
            else:
                frames = message
            reply = p.unpack(service.handle(frames))
            assert isinstance(reply["ok"], bool) and "epoch" in reply
            if not reply["ok"]:
                assert reply["code"] != "internal", reply
                assert reply["code"] and reply["message"]
        finish(service, session)
    finally:
        service.pool.close()


def test_thousands_of_mutated_messages_over_the_socket(memsvc) -> None:
    rng = random.Random(1234)
    with MemClient(memsvc.address) as mem:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(memsvc.address)
        codes: dict[str, int] = {}
        try:
            base = valid_messages(mem.session)
            for _ in range(2000):
                frames = mutate(rng.choice(base), rng) if rng.random() < 0.9 else rng.choice(base)
                sock.send_multipart(frames)
                reply = p.unpack(sock.recv_multipart())
                code = "ok" if reply["ok"] else reply["code"]
                codes[code] = codes.get(code, 0) + 1
        finally:
            sock.close(0)
            ctx.term()
        # every kind of outcome happened, and none was an internal error (a bug)
        assert "internal" not in codes, codes
        assert codes["ok"] and codes["malformed"] and codes["bad_request"], codes
        mem.check()
    # closing said goodbye: whatever the fuzzed ops opened is reclaimed
    with MemClient(memsvc.address) as mem:
        mem.check(idle=True)
