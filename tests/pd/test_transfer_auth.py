"""The PD transfer socket with CURVE: who may connect, and who may write a room.

memsvc-D's transfer listener serves with the stack's server key and accepts
only the client keys in ``--curve-clients``; a room is bound to the peer whose
``query`` opened it, so ``data`` / ``done`` / ``abort`` from any other peer
change nothing. The hand-made peers here speak the transfer protocol the way
memsvc-P does (``memsvc.transfer``).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth

from memsvc.client import MemClient
from memsvc.curve import CurveClientKeys, KeyFolder, make_client
from memsvc.movers import pack_frames
from memsvc.transfer import KVPoll

ROOM, RID, NUM_TOKENS = 7, "r", 8  # two pages of 4 tokens


class Keys:
    """The stack's keys, one more accepted client key, and a key nobody accepts."""

    def __init__(self, tmp_path: Path) -> None:
        self.folder = KeyFolder.ensure(tmp_path / "keys")
        other_public, self.other_secret = zmq.auth.create_certificates(tmp_path, "other")
        shutil.copy(other_public, self.folder.clients)
        _, self.stranger_secret = zmq.auth.create_certificates(tmp_path, "stranger")

    def client(self, secret: str | Path | None = None) -> CurveClientKeys:
        return CurveClientKeys.from_files(
            self.folder.server_public, secret or self.folder.client_secret
        )


class TransferPeer:
    """A DEALER on the transfer listener, sending what memsvc-P sends."""

    def __init__(self, address: str, curve: CurveClientKeys | None) -> None:
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 500)  # a refused peer has nowhere to send
        make_client(self.sock, curve)
        self.sock.connect(address)

    def send(self, header: dict, payload: np.ndarray | None = None) -> None:
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart(pack_frames(header, payload))

    def reply(self, timeout_s: float = 2.0) -> dict | None:
        if not self.sock.poll(timeout_s * 1000):
            return None
        return msgpack.unpackb(self.sock.recv_multipart()[0], raw=False)

    def query(self, timeout_s: float = 2.0) -> dict | None:
        self.send({"t": "query", "room": ROOM, "rid": RID})
        return self.reply(timeout_s)

    def write(self, pages: np.ndarray) -> None:
        self.send({"t": "data", "room": ROOM, "start": 0}, pages)

    def done(self, timeout_s: float = 2.0) -> dict | None:
        self.send(
            {"t": "done", "room": ROOM, "rid": RID, "num_tokens": NUM_TOKENS, "first_token": 5}
        )
        return self.reply(timeout_s)

    def close(self) -> None:
        self.sock.close(0)
        self._ctx.term()


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


@pytest.fixture
def peers():
    opened: list[TransferPeer] = []

    def open_peer(address: str, curve: CurveClientKeys | None) -> TransferPeer:
        opened.append(TransferPeer(address, curve))
        return opened[-1]

    yield open_peer
    for peer in opened:
        peer.close()


def decode_memsvc(memsvc_factory, tmp_path: Path, *curve: str):
    listen = f"ipc://{tmp_path}/transfer.sock"
    args = ["--pd-role", "decode", "--transfer-listen", listen, "--transfer-backend", "zmq"]
    args += ["--transfer-timeout", "60"]  # no prefill memsvc says hello here: rooms must wait
    return memsvc_factory(*args, *curve, name="d"), listen


def room_state(mem: MemClient) -> KVPoll:
    return KVPoll(mem.pd_status([ROOM])[0]["state"])


def expect_room(mem: MemClient) -> np.ndarray:
    """The decode side's room for RID; returns the pages it receives into."""
    mem.alloc_row(RID)
    slots = mem.alloc_extend([(RID, NUM_TOKENS)]).slots
    mem.pd_expect(RID, ROOM)
    return np.unique(slots // mem.layout.page_size)


def finish(mem: MemClient) -> None:
    mem.pd_forget([ROOM])
    mem.free_row(RID)
    mem.check(idle=True)


def test_prefill_memsvc_with_the_stack_keys_transfers(memsvc_factory, tmp_path, keys) -> None:
    curve = keys.folder.service_args()
    decode, listen = decode_memsvc(memsvc_factory, tmp_path, *curve)
    prefill = memsvc_factory(
        "--pd-role", "prefill", "--transfer-peer", listen, "--transfer-backend", "zmq", *curve,
        name="p",
    )  # fmt: skip
    with (
        MemClient(prefill.address, curve=keys.client()) as p,
        MemClient(decode.address, curve=keys.client()) as d,
        p.attach() as p_pool,
        d.attach() as d_pool,
    ):
        d_pages = expect_room(d)
        p.alloc_row(RID)
        p_slots = p.alloc_extend([(RID, NUM_TOKENS)]).slots
        p_pages = np.unique(p_slots // p.layout.page_size)
        shape = p_pool.kv[p_pages].shape
        p_pool.kv[p_pages] = np.arange(np.prod(shape)).reshape(shape)
        p.pd_send(RID, ROOM, NUM_TOKENS, first_token=42)
        deadline = time.monotonic() + 30
        while room_state(d) in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING):
            assert time.monotonic() < deadline, "the transfer did not finish"
            time.sleep(0.01)
        assert room_state(d) == KVPoll.SUCCESS, d.pd_status([ROOM])
        np.testing.assert_array_equal(d_pool.kv[d_pages], p_pool.kv[p_pages])
        p.pd_forget([ROOM])
        p.release(RID, is_insert=False)
        p.check(idle=True)
        finish(d)


def test_unauthenticated_transfer_peers_are_refused(memsvc_factory, tmp_path, keys, peers):
    decode, listen = decode_memsvc(memsvc_factory, tmp_path, *keys.folder.service_args())
    with MemClient(decode.address, curve=keys.client()) as d:
        expect_room(d)
        for curve in (None, keys.client(keys.stranger_secret)):  # no keys; a key not accepted
            stranger = peers(listen, curve)
            assert stranger.query(0.5) is None  # the handshake failed: nothing got through
            stranger.write(np.zeros(1, np.float32))
            assert stranger.done(0.5) is None
            assert room_state(d) == KVPoll.WAITING_FOR_INPUT
        assert peers(listen, keys.client()).query()["t"] == "ready"  # an accepted key
        assert room_state(d) == KVPoll.TRANSFERRING
        finish(d)


@pytest.mark.parametrize("with_curve", [True, False], ids=["curve", "plain"])
def test_a_room_takes_writes_only_from_the_peer_that_opened_it(
    memsvc_factory, tmp_path, keys, peers, with_curve
) -> None:
    curve = keys.folder.service_args() if with_curve else []
    decode, listen = decode_memsvc(memsvc_factory, tmp_path, *curve)
    owner_keys = keys.client() if with_curve else None
    with MemClient(decode.address, curve=owner_keys) as d, d.attach() as pool:
        pages = expect_room(d)
        owner = peers(listen, owner_keys)
        other = peers(listen, keys.client(keys.other_secret) if with_curve else None)
        page_shape = d.layout.kv_shape[1:]
        dtype = d.layout.storage_dtype

        # Before anyone opened it, the room takes no data and no done.
        other.write(np.full((2, *page_shape), 9, dtype))
        assert other.done()["ok"] is False
        assert room_state(d) == KVPoll.WAITING_FOR_INPUT

        ready = owner.query()
        assert ready["t"] == "ready" and ready["num_tokens"] == NUM_TOKENS
        assert np.frombuffer(ready["pages"], np.int64).tolist() == pages.tolist()
        if with_curve:  # another key learns nothing of the room and moves nothing
            refused = other.query()
            assert refused["t"] == "failed" and "bound to another" in refused["why"]
        other.write(np.full((2, *page_shape), 9, dtype))
        refused = other.done()
        assert refused["ok"] is False and "bound to another" in refused["why"]
        other.send({"t": "abort", "room": ROOM, "why": "hostile"})
        assert other.reply(0.2) is None
        assert room_state(d) == KVPoll.TRANSFERRING
        assert not (pool.kv[pages] == 9).any()

        written = np.arange(np.prod(page_shape) * 2, dtype=dtype).reshape(2, *page_shape)
        owner.write(written)
        assert owner.done() == {"t": "ack", "room": ROOM, "ok": True, "why": ""}
        assert room_state(d) == KVPoll.SUCCESS
        np.testing.assert_array_equal(pool.kv[pages], written)
        finish(d)
