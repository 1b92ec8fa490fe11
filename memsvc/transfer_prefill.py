"""memsvc-P's part of PD transfers: sending a request's pages to the decode node.

A send queries its room (backing off from 2 ms to 100 ms) until the decode
side answers ``ready`` with the room's pages, writes them through the mover,
says ``done`` and waits for the ``ack``. It fails when the decode side stops
answering for ``peer_timeout_s``, or does not expect the room within
``bootstrap_timeout_s`` of the send (SGLang's
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``; "not_ready" answers do not move
that deadline). The rooms themselves are :mod:`memsvc.transfer_rooms`'.
"""

from __future__ import annotations

import time

import numpy as np
import zmq

from memsvc.core.backends.base import aligned_pages
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool
from memsvc.curve import CurveKeys, make_client
from memsvc.limits import DEFAULT_LIMIT
from memsvc.movers import NixlMover, ZmqMover, pack_frames
from memsvc.rpc import send_or_drop
from memsvc.transfer_rooms import (
    BOOTSTRAP_TIMEOUT_ENV,
    HELLO_INTERVAL_S,
    QUERY_RETRY_S,
    KVPoll,
    Peer,
    Room,
    RoomBook,
    page_geometry,
    swa_window_pages,
)


class PrefillSide:
    """The prefill role's sends to its one decode peer (see the module docstring)."""

    routed = False  # a DEALER to the configured peer: messages carry no routing id

    def __init__(
        self,
        pool: KVPool,
        mover: NixlMover | ZmqMover,
        book: RoomBook,
        *,
        peer_address: str,
        epoch: str,
        curve: CurveKeys,
        peer_timeout_s: float,
        bootstrap_timeout_s: float,
    ) -> None:
        self.pool, self.mover, self.book = pool, mover, book
        self.rooms = book.rooms
        self.peer_address = peer_address
        self.epoch = epoch
        self.curve = curve
        self.peer_timeout_s = peer_timeout_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.page_size = pool.page_size
        # It hears only its configured peer (whose "ready" carries NIXL metadata).
        self.limit = DEFAULT_LIMIT
        self.sock: zmq.Socket | None = None
        self.last_peer_seen = time.monotonic()
        self.next_hello = 0.0

    def open(self, ctx: zmq.Context) -> zmq.Socket:
        """Connect to the decode node's listener (with the CURVE client keys, if any)."""
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # One routing id for this process's life: a reconnect keeps the rooms it opened.
        self.sock.setsockopt(zmq.ROUTING_ID, f"memsvc-prefill-{self.epoch}".encode())
        make_client(self.sock, self.curve.client)
        self.sock.connect(self.peer_address)
        return self.sock

    def progress(self, now: float) -> float:
        """Say hello, advance every send; returns seconds until it wants to run again."""
        wake = 0.25
        if now >= self.next_hello:
            self._to_decode(pack_frames({"t": "hello"}))
            self.next_hello = now + HELLO_INTERVAL_S
        for room in list(self.rooms.values()):
            wake = min(wake, self._advance_send(room, now))
        return wake

    def cancel(self, room: Room) -> None:
        """A room dropped in flight: tell the decode side."""
        self._to_decode(pack_frames({"t": "abort", "room": room.room, "why": "cancelled"}))

    def on_message(self, peer: Peer | None, header: dict, payload: list[bytes]) -> None:
        self._on_decode_reply(header.get("t"), header)

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
        if room_id in self.rooms:
            raise InvalidArgumentError(f"bootstrap room {room_id} is already in use")
        req = self.pool.request(rid)
        if not 0 < num_tokens <= req.kv_len:
            raise InvalidArgumentError(f"{rid!r} has KV for {req.kv_len} tokens, not {num_tokens}")
        pages = aligned_pages(self.pool.slots(rid, 0, num_tokens), self.page_size)
        if pages is None:
            raise InvalidArgumentError(f"{rid!r}'s slots are not page-aligned")
        swa_pages = swa_window_pages(self.pool, pages, num_tokens)  # hybrid: the window's
        now = time.monotonic()
        room = Room(room_id, rid, pages, num_tokens, KVPoll.BOOTSTRAPPING, created=now)
        room.swa_pages = swa_pages
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
            self.book.finish(room, "the decode node did not confirm the transfer")
        return 0.25

    def _bootstrap_failed(self, room: Room, now: float) -> bool:
        """Fail a send still bootstrapping: its peer went silent, or its deadline passed."""
        if now - room.waiting_since > self.peer_timeout_s and now - self.last_peer_seen > (
            self.peer_timeout_s
        ):
            self.book.finish(room, f"decode node unreachable for {self.peer_timeout_s:.1f}s")
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
            self.book.finish(room, f"decode side: {header.get('why', '')}")
        elif kind == "ready" and room.state is KVPoll.BOOTSTRAPPING:
            self._start_send(room, header)
        elif kind == "ack":
            why = None if header.get("ok") else f"decode side: {header.get('why')}"
            self.book.finish(room, why)

    def _start_send(self, room: Room, dest: dict) -> None:
        dst_pages = np.frombuffer(dest["pages"], dtype=np.int64)
        dst_swa = dest.get("swa_pages")
        dst_swa_pages = None if dst_swa is None else np.frombuffer(dst_swa, dtype=np.int64)
        swa_size = None if room.swa_pages is None else room.swa_pages.size
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
        elif (None if dst_swa_pages is None else dst_swa_pages.size) != swa_size:
            self._abort_send(room, "the decode side's SWA window differs from this one")
        else:
            room.state = KVPoll.TRANSFERRING
            room.started = room.waiting_since = time.monotonic()
            layout = self.pool.buffers.layout
            room.bytes = room.pages.size * layout.bytes_per_page
            room.bytes += (swa_size or 0) * layout.swa_bytes_per_page
            try:
                self.mover.start(room, dest["mover"], dst_pages, self.sock, dst_swa_pages)
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
        self.book.finish(room, why)
