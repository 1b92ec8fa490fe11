"""memsvc-D's part of PD transfers: the rooms it expects and the listener peers write to.

A prefill peer queries a room until this side expects it (``not_ready``
until then), is answered ``ready`` with the room's pages, writes them (NIXL,
or zmq ``data`` frames), says ``done`` and gets an ``ack``. Who may touch a
room is :mod:`memsvc.transfer`'s to explain (the binding to the peer that
opened it); the rooms themselves are :mod:`memsvc.transfer_rooms`'.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from memsvc.core.backends.base import aligned_pages
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool
from memsvc.curve import CurveKeys, make_server
from memsvc.movers import NixlMover, ZmqMover, pack_frames
from memsvc.transfer_rooms import (
    KVPoll,
    Peer,
    Room,
    RoomBook,
    listener_limit,
    page_geometry,
    swa_window_pages,
)

log = logging.getLogger("memsvc.transfer")

WAITING = (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING)  # a room whose pages may still come


class DecodeSide:
    """The decode role's rooms and listener (see the module docstring)."""

    routed = True  # the listener is a ROUTER: each message starts with the peer's routing id

    def __init__(
        self,
        pool: KVPool,
        mover: NixlMover | ZmqMover,
        book: RoomBook,
        *,
        listen: str,
        curve: CurveKeys,
        peer_timeout_s: float,
    ) -> None:
        self.pool, self.mover, self.book = pool, mover, book
        self.rooms = book.rooms
        self.listen = listen
        self.curve = curve
        self.peer_timeout_s = peer_timeout_s
        self.page_size = pool.page_size
        self.limit = listener_limit(pool)
        self.sock: zmq.Socket | None = None
        self.last_peer_seen = time.monotonic()

    def open(self, ctx: zmq.Context) -> zmq.Socket:
        """Bind the listener (a CURVE server when memsvc has server keys)."""
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.limit.apply(self.sock)
        if self.curve.server is not None:
            make_server(self.sock, self.curve.server)
        self.sock.bind(self.listen)
        return self.sock

    def progress(self, now: float) -> float:
        """Fail waiting rooms once no prefill peer has been heard for too long; while
        rooms wait for pages, let the mover progress (NIXL: UCX, each millisecond)."""
        silent = now - self.last_peer_seen
        if silent > self.peer_timeout_s:
            for room in self.rooms.values():
                if room.state in WAITING and now - room.created > self.peer_timeout_s:
                    self.book.finish(room, f"prefill node unreachable for {silent:.1f}s")
        if any(room.state in WAITING for room in self.rooms.values()):
            wake = self.mover.progress()
            if wake is not None:
                return wake
        return 0.25

    def cancel(self, room: Room) -> None:
        """A room dropped in flight: nothing to tell the prefill side (its writes are dropped)."""

    def expect(self, rid: str, room_id: int) -> None:
        """The prompt's slots are allocated in ``rid``'s row: wait for them to be written."""
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
        swa_pages = swa_window_pages(self.pool, pages, req.kv_len)  # hybrid: the window's
        now = time.monotonic()
        self.rooms[room_id] = Room(
            room_id, rid, pages, req.kv_len, KVPoll.WAITING_FOR_INPUT, created=now
        )
        self.rooms[room_id].swa_pages = swa_pages

    def on_message(self, peer: Peer | None, header: dict, payload: list[bytes]) -> None:
        kind = header.get("t")
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
            self._receive_data(room, int(header["start"]), payload, header.get("pool") == "swa")
        elif kind == "done":
            ok, why = self._check_done(room, header)
            if room is not None and room.state is not KVPoll.FAILED:
                if ok:
                    room.first_token = int(header["first_token"])
                    room.cached_tokens = int(header.get("cached_tokens", 0))
                self.book.finish(room, None if ok else why)
            self.sock.send_multipart(
                [
                    identity,
                    *pack_frames({"t": "ack", "room": header.get("room"), "ok": ok, "why": why}),
                ]
            )
        elif kind == "abort" and room is not None:
            self.book.finish(room, f"prefill side gave up: {header.get('why', '')}")

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
            self.book.finish(room, reason)
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
            if room.swa_pages is not None:
                reply["swa_pages"] = room.swa_pages.astype(np.int64).tobytes()
        self.sock.send_multipart([peer[0], *pack_frames(reply)])

    def _receive_data(
        self, room: Room | None, start: int, payload: list[bytes], swa: bool = False
    ) -> None:
        """A chunk of the room's full pages, or (``swa``) of its window's SWA pages."""
        if room is None or room.state is not KVPoll.TRANSFERRING or len(payload) != 1:
            return  # cancelled or failed meanwhile: drop the bytes
        layout = self.pool.buffers.layout
        if swa and room.swa_pages is None:
            self.book.finish(room, "SWA transfer data for a room without an SWA window")
            return
        room_pages = room.swa_pages if swa else room.pages
        assert room_pages is not None
        page_shape = layout.swa_kv_shape[1:] if swa else layout.kv_shape[1:]
        data = np.frombuffer(payload[0], dtype=layout.storage_dtype)
        page_items = int(np.prod(page_shape))
        count, rest = divmod(data.size, page_items) if page_items else (0, 1)
        if count == 0 or rest or start < 0 or start + count > room_pages.size:
            self.book.finish(room, "transfer data outside the room's pages")
            return
        pages = room_pages[start : start + count]
        if swa:
            self.pool.buffers.swa_kv[pages] = data.reshape(count, *page_shape)
            room.swa_chunks[start] = count
        else:
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
        full_pages = room.pages.size if self.pool.layout.bytes_per_page else 0  # pure SWA: none
        if self.mover.name == "zmq" and received != full_pages:
            return False, f"received {received} of {full_pages} pages"
        if self.mover.name == "zmq" and room.swa_pages is not None:
            received = sum(room.swa_chunks.values())
            if received != room.swa_pages.size:
                return False, f"received {received} of {room.swa_pages.size} SWA pages"
        return True, ""
