"""PD disaggregation: moving a prompt's KV pages from memsvc-P to memsvc-D.

The schedulers only drive it; the two memsvc processes talk to each other
directly. memsvc-P connects a DEALER to memsvc-D's transfer socket
(``--transfer-listen``)::

    scheduler-D: alloc_row + alloc_extend (the prompt's slots) -> pd_expect(rid, room)
    scheduler-P: prefill, sample the first token              -> pd_send(rid, room, ...)

    memsvc-P ── query(room) ─────────────────────────► memsvc-D   (until D expects the room)
             ◄─ ready(rid, tokens, pages, layout, nixl agent) ─
             ══ pages: NIXL WRITE into D's pool, or zmq data frames ══►
             ── done(room, rid, tokens, first token, cached) ─► validated against the room
             ◄─ ack(ok | why) ─────────────────────────────────

    each scheduler polls its side (pd_status / pd_poll) and acts on Success / Failed

Per-room state (SGLang's ``KVPoll``): Bootstrapping -> WaitingForInput ->
Transferring -> Success, or Failed with a reason. memsvc-P says hello every
:data:`HELLO_INTERVAL_S`; a decode side that hears nothing from any prefill
peer for ``peer_timeout_s`` fails its waiting rooms ("prefill node
unreachable"), and a prefill side whose peer stops answering fails its sends.
A send whose room the decode side still does not expect after
``bootstrap_timeout_s`` (SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``,
300 s) fails too: that deadline runs from the send and no "not_ready" answer
moves it, so a room nobody will expect gives its pages back.

Who may touch a room on the decode side: the transfer listener is a CURVE
server when memsvc has ``--curve-secret-key`` / ``--curve-clients`` (memsvc-P
connects with ``--curve-client-key`` / ``--curve-server-key``), so only
accepted keys get a message through. A room is bound to the peer (its
connection and its CURVE key) whose ``query`` opened it: ``data``, ``done``
and ``abort`` from any other peer are refused and leave the room as it is,
and a ``query`` under another key is answered ``failed`` without touching it.
The same key may open the room again from a new connection (a restarted or
reconnected memsvc-P), which moves the binding there. A room not opened yet
takes no ``data`` or ``done``, only an ``abort`` (the prefill side gives up on
rooms it was never answered for). Without CURVE every peer has the same (no)
key: the binding then only stops writes from a connection that did not open
the room.

Everything here runs on memsvc's socket thread (see :class:`ServiceShell`'s
``extension``), like every op, so it needs no locks.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np
import zmq

from memsvc.core.backends.base import aligned_pages
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool
from memsvc.curve import CurveKeys, make_client, make_server, peer_key
from memsvc.limits import DEFAULT_LIMIT, MessageLimit, recv_bounded
from memsvc.movers import CHUNK_PAGES, NixlMover, ZmqMover, pack_frames
from memsvc.rpc import send_or_drop
from memsvc.transfer_backend import TRANSFER_BACKENDS

log = logging.getLogger("memsvc.transfer")

HELLO_INTERVAL_S = 0.5
QUERY_RETRY_S = (0.002, 0.1)  # first and longest wait between queries for a room not yet expected
BOOTSTRAP_TIMEOUT_ENV, BOOTSTRAP_TIMEOUT_S = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0


def bootstrap_timeout_from_env() -> float:
    """SGLang's prefill-side wait for the decode side to expect a room, in seconds."""
    value = os.environ.get(BOOTSTRAP_TIMEOUT_ENV)
    return BOOTSTRAP_TIMEOUT_S if value in (None, "") else float(value)


class KVPoll(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


Peer = tuple[bytes, str | None]  # a transfer peer: its connection's routing id, its CURVE key


def listener_limit(pool: KVPool) -> MessageLimit:
    """What a prefill peer may send the listener at once: one data chunk and a small header."""
    chunk_bytes = CHUNK_PAGES * pool.buffers.layout.bytes_per_page
    return MessageLimit(max_bytes=chunk_bytes + (1 << 20), max_frames=4, hard_factor=1)


def page_geometry(pool: KVPool) -> list[Any]:
    """What must agree between two pools for their pages to be interchangeable."""
    layout = pool.buffers.layout
    return [layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.page_size, layout.dtype]


@dataclass
class Room:
    """One request's transfer, on either side."""

    room: int
    rid: str
    pages: np.ndarray
    num_tokens: int
    state: KVPoll
    created: float
    why: str = ""
    first_token: int = -1
    cached_tokens: int = 0
    # prefill side
    next_query: float = 0.0
    query_wait: float = QUERY_RETRY_S[0]
    waiting_since: float = 0.0  # when the last message that expects an answer went out
    handle: Any = None
    started: float = 0.0
    # decode side
    chunks: dict[int, int] = field(default_factory=dict)  # zmq: first page -> pages received
    bytes: int = 0
    owner: int = 0  # the memsvc session whose request this is
    peer: Peer | None = None  # decode side: the peer whose query opened the room
    peer_rid: str = ""  # prefill side: the rid the decode side expects

    def report(self) -> dict[str, Any]:
        return {
            "room": self.room,
            "rid": self.rid,
            "state": int(self.state),
            "why": self.why,
            "first_token": self.first_token,
            "cached_tokens": self.cached_tokens,
        }


class TransferAgent:
    """One memsvc's side of PD transfers (``role`` ``prefill`` or ``decode``)."""

    def __init__(
        self,
        pool: KVPool,
        *,
        role: str,
        backend: str,
        epoch: str,
        listen: str | None = None,
        peer: str | None = None,
        peer_timeout_s: float = 5.0,
        bootstrap_timeout_s: float | None = None,
        curve: CurveKeys | None = None,
        allow_remote: bool = False,
    ) -> None:
        if role == "decode" and not listen:
            raise InvalidArgumentError("a decode-role memsvc needs --transfer-listen")
        if role == "prefill" and not peer:
            raise InvalidArgumentError("a prefill-role memsvc needs --transfer-peer")
        if backend not in TRANSFER_BACKENDS:
            raise InvalidArgumentError(f"--transfer-backend must be one of {TRANSFER_BACKENDS}")
        self.pool, self.role, self.listen, self.peer_address = pool, role, listen, peer
        self.peer_timeout_s = peer_timeout_s
        self.epoch = epoch
        # The listener serves with the server keys (the shell's ZAP handler vets its
        # clients); the prefill side connects with the client keys.
        self.curve = curve or CurveKeys()
        if bootstrap_timeout_s is None:
            bootstrap_timeout_s = bootstrap_timeout_from_env()
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.page_size = pool.page_size
        self.mover = (
            NixlMover(pool, f"kvstack-{role}-{epoch}", allow_remote=allow_remote)
            if backend == "nixl"
            else ZmqMover(pool)
        )
        self.rooms: dict[int, Room] = {}
        # The prefill side hears only its configured peer (whose "ready" carries NIXL metadata).
        self.limit = listener_limit(pool) if role == "decode" else DEFAULT_LIMIT
        self.sock: zmq.Socket | None = None
        self.last_peer_seen = time.monotonic()
        self.next_hello = 0.0
        self.counters = {"success": 0, "failed": 0, "bytes": 0, "seconds": 0.0}

    @property
    def backend(self) -> str:
        return self.mover.name

    # -- the ServiceShell extension ----------------------------------------------

    def open(self, ctx: zmq.Context) -> list[zmq.Socket]:
        if self.role == "decode":
            self.sock = ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.limit.apply(self.sock)
            if self.curve.server is not None:
                make_server(self.sock, self.curve.server)
            self.sock.bind(self.listen)
        else:
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            # One routing id for this process's life: a reconnect keeps the rooms it opened.
            self.sock.setsockopt(zmq.ROUTING_ID, f"memsvc-prefill-{self.epoch}".encode())
            make_client(self.sock, self.curve.client)
            self.sock.connect(self.peer_address)
        return [self.sock]

    def on_readable(self, sock: zmq.Socket) -> None:
        while True:
            try:
                inbound = recv_bounded(sock, self.limit, keep=0, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if inbound.too_large is not None:  # read and dropped frame by frame
                log.warning("dropped a transfer message: %s", inbound.too_large.message)
                continue
            raw = inbound.frames
            peer = None
            if self.role == "decode":
                if len(raw) < 2:
                    continue  # a routing id and no message
                peer = (raw.pop(0).bytes, peer_key(raw[0]))
            frames = [frame.bytes for frame in raw]
            try:
                header = msgpack.unpackb(frames[0], raw=False)
                if not isinstance(header, dict):
                    raise ValueError("header is not a map")
                self._on_peer(peer, header, frames[1:])
            except Exception as exc:  # garbage from a peer: drop it, keep serving
                log.warning("dropped a malformed transfer message: %s", exc)

    def progress(self, now: float) -> float:
        """Advance what waits on time; returns seconds until it wants to run again."""
        wake = 0.25
        if self.role == "prefill":
            if now >= self.next_hello:
                self._to_decode(pack_frames({"t": "hello"}))
                self.next_hello = now + HELLO_INTERVAL_S
            for room in list(self.rooms.values()):
                wake = min(wake, self._advance_send(room, now))
        else:
            silent = now - self.last_peer_seen
            if silent > self.peer_timeout_s:
                for room in self.rooms.values():
                    if (
                        room.state in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING)
                        and now - room.created > self.peer_timeout_s
                    ):
                        self._finish(room, f"prefill node unreachable for {silent:.1f}s")
        return max(wake, 0.0)

    def close(self) -> None:
        self.mover.close()
        if self.sock is not None:
            self.sock.close(0)

    # -- decode side ---------------------------------------------------------------

    def expect(self, rid: str, room_id: int) -> None:
        """The prompt's slots are allocated in ``rid``'s row: wait for them to be written."""
        self._need("decode")
        if room_id in self.rooms:
            raise InvalidArgumentError(f"bootstrap room {room_id} is already in use")
        req = self.pool.request(rid)
        if req.protected_len:
            # The peer writes every page of the room: tree pages are other requests' KV.
            raise InvalidArgumentError(
                f"{rid!r} holds a {req.protected_len}-token cached prefix; a room receives "
                "only into the request's own pages"
            )
        slots = self.pool.slots(rid, 0, req.kv_len)
        pages = aligned_pages(slots, self.page_size)
        if pages is None or req.kv_len == 0:
            raise InvalidArgumentError(f"{rid!r} holds no page-aligned slots to receive into")
        now = time.monotonic()
        self.rooms[room_id] = Room(
            room_id, rid, pages, req.kv_len, KVPoll.WAITING_FOR_INPUT, created=now
        )

    def _on_peer(self, peer: Peer | None, header: dict, payload: list[bytes]) -> None:
        kind = header.get("t")
        if self.role == "prefill":
            self._on_decode_reply(kind, header)
            return
        self.last_peer_seen = time.monotonic()
        room = self.rooms.get(header.get("room"))
        identity = peer[0]
        if kind == "hello":
            return
        if kind == "query":
            self._answer_query(peer, room, header)
        elif room is not None and room.peer != peer and (kind, room.peer) != ("abort", None):
            self._refuse(peer, room, kind)
        elif kind == "data":
            self._receive_data(room, int(header["start"]), payload)
        elif kind == "done":
            ok, why = self._check_done(room, header)
            if room is not None and room.state is not KVPoll.FAILED:
                if ok:
                    room.first_token = int(header["first_token"])
                    room.cached_tokens = int(header.get("cached_tokens", 0))
                self._finish(room, None if ok else why)
            self.sock.send_multipart(
                [
                    identity,
                    *pack_frames({"t": "ack", "room": header.get("room"), "ok": ok, "why": why}),
                ]
            )
        elif kind == "abort" and room is not None:
            self._finish(room, f"prefill side gave up: {header.get('why', '')}")

    def _refuse(self, peer: Peer, room: Room, kind: str | None) -> None:
        """``data`` / ``done`` / ``abort`` for ``room`` from a peer that did not open it."""
        why = f"room {room.room} is bound to another transfer peer"
        log.warning("refused %s for room %d from a peer that did not open it", kind, room.room)
        if kind == "done":
            reply = {"t": "ack", "room": room.room, "ok": False, "why": why}
            self.sock.send_multipart([peer[0], *pack_frames(reply)])

    def _answer_query(self, peer: Peer, room: Room | None, header: dict) -> None:
        room_id = header.get("room")
        if room is None:
            reply = {"t": "not_ready", "room": room_id}
        elif room.state is KVPoll.FAILED:
            reply = {"t": "failed", "room": room_id, "why": room.why}
        elif room.peer is not None and room.peer[1] != peer[1]:
            # Opened under another key: this peer learns nothing and changes nothing.
            reply = {"t": "failed", "room": room_id, "why": "bound to another transfer peer"}
        elif room.state is KVPoll.SUCCESS and room.rid == header.get("rid"):
            # A second sender for a room that already has its KV (a re-sent prefill):
            # nothing to write, and the room must not be reopened.
            reply = {"t": "ack", "room": room_id, "ok": True, "why": ""}
        elif room.rid != header.get("rid"):
            reason = (
                f"bootstrap_room mismatch: room {room_id} is {room.rid!r}, "
                f"not {header.get('rid')!r}"
            )
            self._finish(room, reason)
            reply = {"t": "failed", "room": room_id, "why": reason}
        else:
            room.state, room.peer = KVPoll.TRANSFERRING, peer
            reply = {
                "t": "ready",
                "room": room_id,
                "rid": room.rid,
                "num_tokens": room.num_tokens,
                "pages": room.pages.astype(np.int64).tobytes(),
                "geometry": page_geometry(self.pool),
                "mover": self.mover.describe(),
            }
        self.sock.send_multipart([peer[0], *pack_frames(reply)])

    def _receive_data(self, room: Room | None, start: int, payload: list[bytes]) -> None:
        if room is None or room.state is not KVPoll.TRANSFERRING or len(payload) != 1:
            return  # cancelled or failed meanwhile: drop the bytes
        layout = self.pool.buffers.layout
        page_shape = layout.kv_shape[1:]
        data = np.frombuffer(payload[0], dtype=layout.storage_dtype)
        count, rest = divmod(data.size, int(np.prod(page_shape)))
        if count == 0 or rest or start < 0 or start + count > room.pages.size:
            self._finish(room, "transfer data outside the room's pages")
            return
        pages = room.pages[start : start + count]
        self.pool.buffers.scatter_pages(data.reshape(count, *page_shape), pages)
        room.chunks[start] = count  # a duplicated chunk is written again, counted once

    def _check_done(self, room: Room | None, header: dict) -> tuple[bool, str]:
        if room is None:
            return False, f"bootstrap room {header.get('room')} is not expected here"
        if room.state is KVPoll.FAILED:
            return False, room.why
        if room.rid != header.get("rid"):
            return False, "bootstrap_room mismatch"
        if int(header.get("num_tokens", -1)) != room.num_tokens:
            return False, (
                f"token count mismatch: sent {header.get('num_tokens')}, expected {room.num_tokens}"
            )
        received = sum(room.chunks.values())
        if self.backend == "zmq" and received != room.pages.size:
            return False, f"received {received} of {room.pages.size} pages"
        return True, ""

    # -- prefill side --------------------------------------------------------------

    def send(
        self,
        rid: str,
        room_id: int,
        num_tokens: int,
        first_token: int,
        cached: int,
        peer_rid: str | None = None,
    ) -> None:
        """Send the KV of ``rid``'s first ``num_tokens`` positions to the room's decode side.

        ``peer_rid``: the decode side's name for the request, if not ``rid``.
        """
        self._need("prefill")
        if room_id in self.rooms:
            raise InvalidArgumentError(f"bootstrap room {room_id} is already in use")
        req = self.pool.request(rid)
        if not 0 < num_tokens <= req.kv_len:
            raise InvalidArgumentError(f"{rid!r} has KV for {req.kv_len} tokens, not {num_tokens}")
        pages = aligned_pages(self.pool.slots(rid, 0, num_tokens), self.page_size)
        if pages is None:
            raise InvalidArgumentError(f"{rid!r}'s slots are not page-aligned")
        now = time.monotonic()
        room = Room(room_id, rid, pages, num_tokens, KVPoll.BOOTSTRAPPING, created=now)
        room.first_token, room.cached_tokens = first_token, cached
        room.peer_rid = peer_rid or rid
        room.waiting_since = now
        self.rooms[room_id] = room
        self._query(room, now)

    def _query(self, room: Room, now: float) -> None:
        self._to_decode(pack_frames({"t": "query", "room": room.room, "rid": room.peer_rid}))
        room.next_query = now + room.query_wait
        room.query_wait = min(room.query_wait * 2, QUERY_RETRY_S[1])

    def _advance_send(self, room: Room, now: float) -> float:
        if room.state is KVPoll.BOOTSTRAPPING:
            if self._bootstrap_failed(room, now):
                return 1.0
            if now >= room.next_query:
                self._query(room, now)
            return room.next_query - now
        if room.state is KVPoll.TRANSFERRING and room.handle is not None:
            state = self.mover.poll(room)
            if state == "ERR":
                self._abort_send(room, "the NIXL transfer failed")
            elif state == "DONE":
                self._send_done(room, now)
            return 0.0005
        if room.state is KVPoll.TRANSFERRING and now - room.waiting_since > self.peer_timeout_s:
            self._finish(room, "the decode node did not confirm the transfer")
        return 0.25

    def _bootstrap_failed(self, room: Room, now: float) -> bool:
        """Fail a send still bootstrapping: its peer went silent, or its deadline passed."""
        if now - room.waiting_since > self.peer_timeout_s and now - self.last_peer_seen > (
            self.peer_timeout_s
        ):
            self._finish(room, f"decode node unreachable for {self.peer_timeout_s:.1f}s")
        elif now - room.created > self.bootstrap_timeout_s:
            # "not_ready" answers do not move this deadline: a decode side that keeps
            # answering but never expects the room (it moved the request to another
            # room, or dropped it) must not hold these pages for ever.
            self._abort_send(
                room,
                f"the decode side did not expect room {room.room} within "
                f"{self.bootstrap_timeout_s:g}s ({BOOTSTRAP_TIMEOUT_ENV})",
            )
        return room.state is KVPoll.FAILED

    def _on_decode_reply(self, kind: str | None, header: dict) -> None:
        self.last_peer_seen = time.monotonic()
        room = self.rooms.get(header.get("room"))
        if room is None or room.state in (KVPoll.SUCCESS, KVPoll.FAILED):
            return
        if kind == "failed":
            self._finish(room, f"decode side: {header.get('why', '')}")
        elif kind == "ready" and room.state is KVPoll.BOOTSTRAPPING:
            self._start_send(room, header)
        elif kind == "ack":
            self._finish(room, None if header.get("ok") else f"decode side: {header.get('why')}")

    def _start_send(self, room: Room, dest: dict) -> None:
        dst_pages = np.frombuffer(dest["pages"], dtype=np.int64)
        if dest.get("rid") != room.peer_rid:
            self._abort_send(room, "bootstrap_room mismatch")
        elif dest.get("geometry") != page_geometry(self.pool):
            self._abort_send(room, "the decode node's page geometry differs from this one")
        elif (
            int(dest.get("num_tokens", -1)) != room.num_tokens or dst_pages.size != room.pages.size
        ):
            self._abort_send(
                room, f"decode side expects {dest.get('num_tokens')} tokens, have {room.num_tokens}"
            )
        else:
            room.state = KVPoll.TRANSFERRING
            room.started = room.waiting_since = time.monotonic()
            room.bytes = room.pages.size * self.pool.buffers.layout.bytes_per_page
            try:
                self.mover.start(room, dest["mover"], dst_pages, self.sock)
            except Exception as exc:
                self._abort_send(room, f"transfer could not start: {exc}")
                return
            if room.handle is None:  # zmq: already on the wire
                self._send_done(room, room.started)

    def _send_done(self, room: Room, now: float) -> None:
        room.waiting_since = now
        self._to_decode(
            pack_frames(
                {
                    "t": "done",
                    "room": room.room,
                    "rid": room.peer_rid,
                    "num_tokens": room.num_tokens,
                    "first_token": room.first_token,
                    "cached_tokens": room.cached_tokens,
                }
            )
        )

    def _to_decode(self, frames: list) -> None:
        """Send to the decode node without ever blocking memsvc's socket thread.

        A listener whose CURVE refused this memsvc leaves nowhere to queue (see
        :func:`memsvc.rpc.send_or_drop`); what is dropped is sent again (hello,
        query) or ends in the room's timeouts.
        """
        send_or_drop(self.sock, frames)

    def _abort_send(self, room: Room, why: str) -> None:
        self._to_decode(pack_frames({"t": "abort", "room": room.room, "why": why}))
        self._finish(room, why)

    # -- both ----------------------------------------------------------------------

    def forget(self, room_ids: list[int]) -> None:
        """Drop rooms the scheduler is done with; one still in flight is cancelled."""
        for room_id in room_ids:
            room = self.rooms.pop(room_id, None)
            if room is None:
                continue
            if room.state not in (KVPoll.SUCCESS, KVPoll.FAILED):
                if self.role == "prefill":
                    self._to_decode(
                        pack_frames({"t": "abort", "room": room_id, "why": "cancelled"})
                    )
                self.counters["failed"] += 1

    def forget_rid(self, rid: str) -> None:
        """``rid`` was released (a dead session): its pages must not be written any more."""
        self.forget([r.room for r in self.rooms.values() if r.rid == rid])

    def _finish(self, room: Room, why: str | None) -> None:
        if room.state in (KVPoll.SUCCESS, KVPoll.FAILED):
            return
        if why is None:
            room.state = KVPoll.SUCCESS
            self.counters["success"] += 1
            if room.started:
                self.counters["bytes"] += room.bytes
                self.counters["seconds"] += time.monotonic() - room.started
        else:
            room.state, room.why = KVPoll.FAILED, why
            self.counters["failed"] += 1
            log.warning("transfer of room %d (%s) failed: %s", room.room, room.rid, why)

    def report(self, room_id: int) -> dict[str, Any]:
        room = self.rooms.get(room_id)
        if room is None:
            return {"room": room_id, "state": int(KVPoll.FAILED), "why": "unknown room"}
        return room.report()

    def _need(self, role: str) -> None:
        if self.role != role:
            raise InvalidArgumentError(f"this memsvc has the {self.role} role, not {role}")

    def stats(self) -> dict[str, Any]:
        by_state = {s.name.lower(): 0 for s in KVPoll}
        for room in self.rooms.values():
            by_state[room.state.name.lower()] += 1
        return {"backend": self.backend, "role": self.role, **self.counters, "rooms": by_state}
