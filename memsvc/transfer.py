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

A decode node also sends: a running request's KV to another decode node's
listener (issue 32, migration), the way memsvc-P sends a prompt's, to the
peer its ``pd_send`` names (it has no default peer). Its receiving rooms and
its sending rooms are two books, and one room id names one room in either.

Everything here runs on memsvc's socket thread (see :class:`ServiceShell`'s
``extension``), like every op, so it needs no locks.

Modules: this one is :class:`TransferAgent`, the shell extension that reads
the transfer sockets and hands each message to its side,
:mod:`memsvc.transfer_decode` (:class:`DecodeSide`, receiving) or
:mod:`memsvc.transfer_prefill` (:class:`PrefillSide`, sending);
:mod:`memsvc.transfer_rooms` holds the rooms and their states,
:mod:`memsvc.movers` the backends that move the pages (NIXL, zmq).
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import zmq

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool
from memsvc.curve import CurveKeys, peer_key
from memsvc.limits import recv_bounded
from memsvc.movers import NixlMover, ZmqMover
from memsvc.transfer_backend import TRANSFER_BACKENDS
from memsvc.transfer_decode import DecodeSide
from memsvc.transfer_prefill import PrefillSide
from memsvc.transfer_rooms import KVPoll, Room, RoomBook, bootstrap_timeout_from_env

__all__ = ["KVPoll", "Room", "TransferAgent"]  # KVPoll and Room: re-exported

log = logging.getLogger("memsvc.transfer")


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
        self.mover = (
            NixlMover(pool, f"kvstack-{role}-{epoch}", allow_remote=allow_remote)
            if backend == "nixl"
            else ZmqMover(pool)
        )
        # The rooms this memsvc sends from, and (decode role) those it receives into.
        self.sender = PrefillSide(
            pool,
            self.mover,
            RoomBook(),
            peer_address=peer,
            epoch=epoch,
            curve=self.curve,
            peer_timeout_s=peer_timeout_s,
            bootstrap_timeout_s=bootstrap_timeout_s,
            allow_remote=allow_remote,
        )
        self.receiver: DecodeSide | None = None
        if role == "decode":
            self.receiver = DecodeSide(
                pool,
                self.mover,
                RoomBook(),
                listen=listen,
                curve=self.curve,
                peer_timeout_s=peer_timeout_s,
            )
        self.sides: list[DecodeSide | PrefillSide] = [self.sender]
        if self.receiver is not None:
            self.sides.insert(0, self.receiver)
        self.socks: dict[zmq.Socket, DecodeSide | PrefillSide] = {}

    @property
    def backend(self) -> str:
        return self.mover.name

    @property
    def books(self) -> list[RoomBook]:
        return [side.book for side in self.sides]

    def room(self, room_id: int) -> Room | None:
        """The room ``room_id``, sent or received."""
        for book in self.books:
            if room_id in book.rooms:
                return book.rooms[room_id]
        return None

    # -- the ServiceShell extension ----------------------------------------------

    def open(self, ctx: zmq.Context) -> list[zmq.Socket]:
        """The receiver's listener (decode role), then the sender's ROUTER. A decode
        node's sender reaches only the peers a ``pd_send`` names (a running request's
        KV moving to another decode node); a prefill node's, also ``--transfer-peer``."""
        self.socks = {side.open(ctx): side for side in self.sides}
        return list(self.socks)

    def on_readable(self, sock: zmq.Socket) -> None:
        side = self.socks[sock]
        while True:
            try:
                inbound = recv_bounded(sock, side.limit, keep=0, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if inbound.too_large is not None:  # read and dropped frame by frame
                log.warning("dropped a transfer message: %s", inbound.too_large.message)
                continue
            raw = inbound.frames
            if len(raw) < 2:
                continue  # a routing id and no message
            peer = (raw.pop(0).bytes, peer_key(raw[0]))
            frames = [frame.bytes for frame in raw]
            try:
                header = msgpack.unpackb(frames[0], raw=False)
                if not isinstance(header, dict):
                    raise ValueError("header is not a map")
                side.on_message(peer, header, frames[1:])
            except Exception as exc:  # garbage from a peer: drop it, keep serving
                log.warning("dropped a malformed transfer message: %s", exc)

    def progress(self, now: float) -> float:
        """Advance what waits on time; returns seconds until it wants to run again."""
        return max(min(side.progress(now) for side in self.sides), 0.0)

    def close(self) -> None:
        self.mover.close()
        for sock in self.socks:
            sock.close(0)

    # -- the ops ----------------------------------------------------------------------

    def expect(self, rid: str, room_id: int) -> None:
        """The prompt's slots are allocated in ``rid``'s row: wait for them to be written."""
        if self.receiver is None:
            raise InvalidArgumentError(f"this memsvc has the {self.role} role, not decode")
        self._unused(room_id)
        self.receiver.expect(rid, room_id)

    def send(self, rid: str, room_id: int, *args: Any, **kwargs: Any) -> None:
        """Send ``rid``'s KV to the room's decode side (:meth:`PrefillSide.send` says
        with what arguments). On a decode node that is a running request moving to
        another decode node (``peer`` names its transfer socket)."""
        self._unused(room_id)
        self.sender.send(rid, room_id, *args, **kwargs)

    def _unused(self, room_id: int) -> None:
        """One id names one room: ``pd_status`` and ``pd_forget`` must not be ambiguous."""
        if self.room(room_id) is not None:
            raise InvalidArgumentError(f"bootstrap room {room_id} is already in use")

    def forget(self, room_ids: list[int]) -> None:
        """Drop rooms the scheduler is done with; one still in flight is cancelled."""
        for room_id in room_ids:
            for side in self.sides:
                room = side.book.rooms.pop(room_id, None)
                if room is not None and room.state not in (KVPoll.SUCCESS, KVPoll.FAILED):
                    side.cancel(room)
                    side.book.cancelled(room)

    def forget_rid(self, rid: str) -> None:
        """``rid`` was released (a dead session): its pages must not be read or written
        any more."""
        self.forget([r.room for book in self.books for r in book.rooms.values() if r.rid == rid])

    def report(self, room_id: int) -> dict[str, Any]:
        room = self.room(room_id)
        if room is None:
            return self.sender.book.report(room_id)  # "unknown room"
        return room.report()

    def stats(self) -> dict[str, Any]:
        """Counted over both directions (a decode node's sends are migrations)."""
        out: dict[str, Any] = {"backend": self.backend, "role": self.role}
        for book in self.books:
            for key, value in book.stats().items():
                if key == "rooms":
                    rooms = out.setdefault("rooms", dict.fromkeys(value, 0))
                    for state, count in value.items():
                        rooms[state] += count
                else:
                    out[key] = out.get(key, 0) + value
        return out
