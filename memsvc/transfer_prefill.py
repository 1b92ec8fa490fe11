"""memsvc-P's part of PD transfers: sending a request's pages to a decode node.

Each send goes to a decode node's transfer socket: the one ``pd_send`` names
(``peer``: what a decode node behind SGLang's router, SMG, told the prefill
node), else the configured one (``--transfer-peer``). One ROUTER socket
reaches them all: each decode listener is connected under its address as
routing id, and this side keeps, per peer, when it last heard from it.

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
from dataclasses import dataclass

import numpy as np
import zmq

from memsvc.core.backends.base import aligned_pages
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool
from memsvc.curve import CurveKeys, make_client
from memsvc.limits import DEFAULT_LIMIT
from memsvc.movers import CHUNK_PAGES, NixlMover, ZmqMover, pack_frames
from memsvc.rpc import send_or_drop
from memsvc.server import check_listen_address
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


@dataclass(slots=True)
class PeerLink:
    """One decode node's transfer socket, as this side reaches it."""

    routing_id: bytes  # its address: the id this side's ROUTER connected it under
    last_seen: float
    next_hello: float = 0.0


class _Routed:
    """``send_multipart`` to one peer of a ROUTER (what a mover sends its pages on)."""

    def __init__(self, sock: zmq.Socket, routing_id: bytes) -> None:
        self.sock, self.routing_id = sock, routing_id

    def send_multipart(self, frames: list, flags: int = 0) -> None:
        self.sock.send_multipart([self.routing_id, *frames], flags)


class PrefillSide:
    """The prefill role's sends to decode peers (see the module docstring)."""

    routed = True  # a ROUTER: each message comes with its peer's routing id

    def __init__(
        self,
        pool: KVPool,
        mover: NixlMover | ZmqMover,
        book: RoomBook,
        *,
        peer_address: str | None,
        epoch: str,
        curve: CurveKeys,
        peer_timeout_s: float,
        bootstrap_timeout_s: float,
        allow_remote: bool = False,
    ) -> None:
        self.pool, self.mover, self.book = pool, mover, book
        self.rooms = book.rooms
        self.peer_address = peer_address  # the default peer (--transfer-peer), if any
        self.links: dict[str, PeerLink] = {}
        self.allow_remote = allow_remote
        self.epoch = epoch
        self.curve = curve
        self.peer_timeout_s = peer_timeout_s
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.page_size = pool.page_size
        # It hears only the peers it connected (whose "ready" carries NIXL metadata).
        self.limit = DEFAULT_LIMIT
        self.sock: zmq.Socket | None = None

    def open(self, ctx: zmq.Context) -> zmq.Socket:
        """The ROUTER that reaches the decode listeners (with the CURVE client keys, if
        any); connected at once to the configured peer."""
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # One routing id for this process's life: a reconnect keeps the rooms it opened.
        self.sock.setsockopt(zmq.ROUTING_ID, f"memsvc-prefill-{self.epoch}".encode())
        make_client(self.sock, self.curve.client)
        if self.peer_address:
            self._link(self.peer_address)
        return self.sock

    def _link(self, address: str) -> PeerLink:
        """The link to the decode listener at ``address``, connected on first use."""
        link = self.links.get(address)
        if link is None:
            assert self.sock is not None
            if address != self.peer_address:
                try:
                    check_listen_address(address, allow_remote=self.allow_remote)
                except InvalidArgumentError:
                    raise InvalidArgumentError(
                        f"peer {address!r}: a decode node's transfer socket must be ipc://PATH "
                        "or tcp://HOST:PORT on loopback (memsvc --allow-remote: any host)"
                    ) from None
            routing_id = address.encode()
            self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, routing_id)
            self.sock.connect(address)
            link = self.links[address] = PeerLink(routing_id, time.monotonic())
        return link

    def progress(self, now: float) -> float:
        """Say hello, advance every send; returns seconds until it wants to run again."""
        wake = 0.25
        for address, link in self.links.items():
            if now >= link.next_hello:
                self._to_decode(address, pack_frames({"t": "hello"}))
                link.next_hello = now + HELLO_INTERVAL_S
        for room in list(self.rooms.values()):
            wake = min(wake, self._advance_send(room, now))
        return wake

    def cancel(self, room: Room) -> None:
        """A room dropped in flight: tell the decode side."""
        frames = pack_frames({"t": "abort", "room": room.room, "why": "cancelled"})
        self._to_decode(room.peer_address, frames)

    def on_message(self, peer: Peer | None, header: dict, payload: list[bytes]) -> None:
        if peer is None:
            return
        address = peer[0].decode(errors="replace")
        link = self.links.get(address)
        if link is None:
            return  # not a listener this side connected
        link.last_seen = time.monotonic()
        self._on_decode_reply(address, header.get("t"), header)

    def send(
        self,
        rid: str,
        room_id: int,
        num_tokens: int,
        first_token: int,
        cached: int,
        peer_rid: str | None = None,
        peer: str | None = None,
        from_host: bool = False,
    ) -> None:
        """Send the KV of ``rid``'s first ``num_tokens`` positions to the room's decode side.

        ``peer_rid``: the decode side's name for the request, if not ``rid``; ``peer``:
        the decode node's transfer socket, if not the configured one; ``from_host``:
        the KV is ``rid``'s host-store entry (a retracted request migrating), all of it,
        sent as data frames whatever the backend.
        """
        if room_id in self.rooms:
            raise InvalidArgumentError(f"bootstrap room {room_id} is already in use")
        address = peer or self.peer_address
        if not address:
            raise InvalidArgumentError(
                "no decode node to send to: pd_send names no peer and memsvc has no --transfer-peer"
            )
        swa_host_pages = None
        if from_host:
            host_pages, swa_host_pages = self._host_pages(rid, num_tokens)
            pages, swa_pages = np.arange(host_pages.shape[0]), None
            if swa_host_pages is not None:  # hybrid: the window's, counted as the room's
                swa_pages = np.arange(swa_host_pages.shape[0])
        else:
            host_pages = None
            req = self.pool.request(rid)
            if not 0 < num_tokens <= req.kv_len:
                message = f"{rid!r} has KV for {req.kv_len} tokens, not {num_tokens}"
                raise InvalidArgumentError(message)
            pages = aligned_pages(self.pool.slots(rid, 0, num_tokens), self.page_size)
            if pages is None:
                raise InvalidArgumentError(f"{rid!r}'s slots are not page-aligned")
            swa_pages = swa_window_pages(self.pool, pages, num_tokens)  # hybrid: the window's
        now = time.monotonic()
        room = Room(room_id, rid, pages, num_tokens, KVPoll.BOOTSTRAPPING, created=now)
        room.swa_pages, room.host_pages = swa_pages, host_pages
        room.swa_host_pages = swa_host_pages
        room.first_token, room.cached_tokens = first_token, cached
        room.peer_rid = peer_rid or rid
        room.peer_address = address
        room.waiting_since = now
        self._link(address)  # before the room exists: a refused address leaves nothing
        self.rooms[room_id] = room
        self._query(room, now)

    def _host_pages(self, rid: str, num_tokens: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``rid``'s host-store pages, which must hold exactly ``num_tokens`` tokens, and
        (a hybrid pool) its SWA pages, which must be the window's: what the decode side
        expects (:func:`~memsvc.transfer_rooms.swa_window_pages`)."""
        store = self.pool.host_store
        held, host_pages = store.pages(rid)
        if held != num_tokens:
            raise InvalidArgumentError(
                f"{rid!r}'s host-store entry holds {held} tokens, not {num_tokens}"
            )
        if not self.pool.layout.is_hybrid:
            return host_pages, None
        swa_from, swa_pages = store.window_pages(rid)
        window = store.swa_tail_start(num_tokens)
        if swa_from != window:
            raise InvalidArgumentError(
                f"{rid!r}'s host-store entry keeps SWA KV from position {swa_from}, not from "
                f"its window's start {window}"
            )
        return host_pages, swa_pages

    def _query(self, room: Room, now: float) -> None:
        frames = pack_frames({"t": "query", "room": room.room, "rid": room.peer_rid})
        self._to_decode(room.peer_address, frames)
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
            return 0.001  # the poll drives UCX (no progress thread): each ms
        if room.state is KVPoll.TRANSFERRING and now - room.waiting_since > self.peer_timeout_s:
            self.book.finish(room, "the decode node did not confirm the transfer")
        return 0.25

    def _bootstrap_failed(self, room: Room, now: float) -> bool:
        """Fail a send still bootstrapping: its peer went silent, or its deadline passed."""
        last_seen = self.links[room.peer_address].last_seen
        if now - room.waiting_since > self.peer_timeout_s and now - last_seen > (
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

    def _on_decode_reply(self, address: str, kind: str | None, header: dict) -> None:
        room = self.rooms.get(header.get("room"))
        if room is None or room.state in (KVPoll.SUCCESS, KVPoll.FAILED):
            return
        if room.peer_address != address:
            return  # another decode node's answer: not its room
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
                peer = _Routed(self.sock, self.links[room.peer_address].routing_id)
                if room.host_pages is not None:
                    send_host_pages(room, peer)
                else:
                    self.mover.start(room, dest["mover"], dst_pages, peer, dst_swa_pages)
            except Exception as exc:
                self._abort_send(room, f"transfer could not start: {exc}")
                return
            if room.handle is None:  # zmq: already on the wire
                self._send_done(room, room.started)

    def _send_done(self, room: Room, now: float) -> None:
        room.waiting_since = now
        self._to_decode(
            room.peer_address,
            pack_frames(
                {
                    "t": "done",
                    "room": room.room,
                    "rid": room.peer_rid,
                    "num_tokens": room.num_tokens,
                    "first_token": room.first_token,
                    "cached_tokens": room.cached_tokens,
                }
            ),
        )

    def _to_decode(self, address: str, frames: list) -> None:
        """Send to the decode node at ``address`` without ever blocking memsvc's socket
        thread.

        A peer not connected yet, or whose CURVE refused this memsvc, is not
        routable: the ROUTER drops the message (see :func:`memsvc.rpc.send_or_drop`);
        what is dropped is sent again (hello, query) or ends in the room's timeouts.
        """
        send_or_drop(self.sock, [self.links[address].routing_id, *frames])

    def _abort_send(self, room: Room, why: str) -> None:
        frames = pack_frames({"t": "abort", "room": room.room, "why": why})
        self._to_decode(room.peer_address, frames)
        self.book.finish(room, why)


def send_host_pages(room: Room, peer: _Routed) -> None:
    """A host-store entry's pages as zmq data frames (what :class:`ZmqMover` sends from the
    pool), then (hybrid) its window's SWA pages (``pool: swa``): the receiver writes them
    into the room's pages whatever its backend."""
    assert room.host_pages is not None
    parts = [(room.host_pages, {})]
    if room.swa_host_pages is not None:
        parts.append((room.swa_host_pages, {"pool": "swa"}))
    for pages, pool in parts:
        for start in range(0, pages.shape[0], CHUNK_PAGES):
            chunk = np.ascontiguousarray(pages[start : start + CHUNK_PAGES])
            header = {"t": "data", "room": room.room, "start": start, **pool}
            peer.send_multipart(pack_frames(header, chunk))
    room.host_pages = room.swa_host_pages = None  # on the wire: the entry may go
