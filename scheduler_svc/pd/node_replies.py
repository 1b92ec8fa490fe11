"""What the router does with its nodes' replies, and when the prefill side of a flight fails.

The decode node's stream is relayed to the client (a generate it calls
``malformed`` is sent again; a ``rebootstrap`` reply re-prefills a victim
through the prefill node under a fresh room). The prefill node's answers end
a flight's wait for its KV: a rejection fails the flight (the decode side is
aborted and the client gets the prefill node's error), and a redrive waiting
for the prefill node's earlier answers prefills the prompt again.
:mod:`scheduler_svc.pd.node_watch` uses the same two reactions for a silent or
restarted prefill node.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import zmq.asyncio

from memsvc import protocol as wire
from scheduler_svc.engine import seed_from_rid
from scheduler_svc.pd.flight import Flight, error_header, is_abort, unpack_reply

if TYPE_CHECKING:
    from scheduler_svc.pd.router import Router

log = logging.getLogger("scheduler_svc.pd.router")

MAX_DECODE_RESENDS = 3  # a generate the decode node calls malformed (damaged on the way)
ENDPOINTS = ("tcp://", "ipc://")  # where a decode node may say a request moved


class NodeReplies:
    """Reads both nodes' replies for ``router`` and acts on each flight they concern."""

    def __init__(self, router: Router) -> None:
        self.router = router

    # -- decode node -------------------------------------------------------------------

    async def from_decode(self, address: str, sock: zmq.asyncio.Socket) -> None:
        """The replies of the decode node at ``address``."""
        router = self.router
        while True:
            header = unpack_reply(await sock.recv_multipart(), f"decode node {address}")
            if header is None or router.answered(header):
                continue
            flight = router.by_decode_op.get(header.get("op_id"))
            if flight is None:
                continue
            kind = header.get("type")
            if kind == "rebootstrap":
                await self._rebootstrap(flight, header)
                continue
            if kind == "moved" and header.get("ok"):
                await self._follow(flight, header)
                continue
            ok = header.get("ok")
            if not ok and header.get("code") == "malformed" and flight.resends < MAX_DECODE_RESENDS:
                flight.resends += 1  # the generate was damaged on the way: send it again
                await router.send_decode(flight)
                continue
            if kind == "chunk":
                end = int(header.get("offset", 0)) + len(header.get("token_ids") or ())
                flight.seen = max(flight.seen, end)
                if end > flight.commit_mark:
                    flight.current = None  # decoding past it: the KV it waited for arrived
            if kind == "done" or not ok:
                await router.end(flight, cleanup=header.get("code") != "duplicate_rid")
                if flight.prefill_error is not None and is_abort(header):
                    header = flight.prefill_error  # say why the prefill side failed
            await router.reply(flight.identity, wire.pack({**header, "op_id": flight.op_id}))

    async def _follow(self, flight: Flight, header: dict) -> None:
        """The decode node moved the request to its peer with its KV: re-submit it there,
        where it attaches to the moved request (the stream restarts at offset 0; the
        client drops what it already has). A peer address that is not a ZMQ endpoint
        fails the request (502)."""
        peer = header.get("peer")
        router = self.router
        if not (isinstance(peer, str) and peer.startswith(ENDPOINTS) and len(peer) < 512):
            why = f"the decode node moved request {flight.rid!r} to a bad address {peer!r}"
            log.error("%s", why)
            await router.end(flight)
            error = {**error_header("moved", why, 502), "op_id": flight.op_id}
            await router.reply(flight.identity, wire.pack(error))
            return
        router.stats["moves_followed"] += 1
        flight.decode_address = peer
        router.decode_node(peer)
        await router.send_decode(flight)

    async def _rebootstrap(self, flight: Flight, header: dict) -> None:
        """The decode node re-prefills a victim through us: origin + output[:-1], one token.

        The prefill node samples under the request's own seed (the rid's, if it
        set none), so a request whose first token is sampled again gets the same.
        """
        room = int(header["room"])
        if any(h.get("bootstrap_room") == room for h, _ in flight.prefill_ops.values()):
            return  # the same re-bootstrap twice (duplicated on the way)
        self.router.stats["rebootstraps"] += 1
        sampling = {**flight.header["sampling"], "max_new_tokens": 1, "ignore_eos": True}
        sampling["seed"] = sampling.get("seed") or seed_from_rid(flight.rid)
        request = {
            "op": "generate",
            "rid": f"{flight.rid}:rb{room}",
            "client": flight.client,
            "sampling": sampling,
            "stream": False,
            "priority": flight.header.get("priority"),
            "bootstrap_room": room,
            "bootstrap_rid": flight.rid,
            # the same cache keys (SGLang's re-bootstrap keeps extra_key): same namespace
            **{k: flight.header[k] for k in ("cache_salt", "extra_key") if k in flight.header},
        }
        ids = np.asarray(header["input_ids"], dtype=wire.ARRAY_DTYPE)
        outputs = ids.size + 1 - flight.prompt_len if flight.prompt_len else 0
        await self._drop_superseded_prefills(flight)
        await self.router.send_prefill(
            flight, request, {"input_ids": ids}, max(flight.seen, outputs)
        )

    async def _drop_superseded_prefills(self, flight: Flight) -> None:
        """A re-bootstrap moves the request to a new room: abort what serves the old ones.

        The decode node no longer expects those rooms, so a prefill still running
        (or sending) for one would hold its pages on the prefill node until its
        deadline, and the queue behind it would wait. A redrive waiting for those
        prefills to end is superseded too: the decode node asked for this room.
        """
        flight.redrive_pending = False
        router = self.router
        await router.abort_on_prefill(router.drop_prefill_ops(flight), flight.client)

    # -- prefill node ------------------------------------------------------------------

    async def from_prefill(self) -> None:
        router = self.router
        while True:
            header = unpack_reply(await router.prefill.recv_multipart(), "prefill")
            if header is None:
                continue
            router.prefill_seen = time.monotonic()
            if router.answered(header) or header.get("type") == "chunk":
                continue
            op = header.get("op_id")
            flight = router.by_prefill_op.pop(op, None)
            if flight is None:
                continue
            flight.prefill_ops.pop(op, None)
            if flight.redrive_pending:
                if not flight.prefill_ops:
                    await self.prefill_again(flight)
                continue
            if op != flight.current:
                continue  # superseded (re-sent or re-bootstrapped since): only the latest counts
            flight.current = None
            if not header.get("ok") or is_abort(header):
                await self.prefill_failed(flight, header)

    async def prefill_failed(self, flight: Flight, header: dict) -> None:
        """Tell the client why (once the decode side has ended the request)."""
        router = self.router
        router.stats["prefill_errors"] += 1
        if header.get("ok"):  # a done that ended in an abort: pass its reason on
            reason = header["meta_info"]["finish_reason"]
            header = {
                "ok": False,
                "code": "prefill_failed",
                "message": reason.get("message", ""),
                "status_code": reason.get("status_code", 500),
            }
        flight.prefill_error = header
        abort = {"op": "abort", "rid": flight.rid, "client": flight.client}
        frames = wire.pack({**abort, "op_id": router.next_op()})
        await router.decode_of(flight).send_multipart(frames)

    async def prefill_again(self, flight: Flight) -> None:
        """The prompt once more, under a new name on the prefill node (its first token seeded)."""
        flight.redrive_pending = False
        sampling = dict(flight.header["sampling"])
        sampling["seed"] = sampling.get("seed") or seed_from_rid(flight.rid)
        request = {
            **flight.header,
            "sampling": sampling,
            "stream": False,
            "rid": f"{flight.rid}:rd{flight.redrives}",
            "bootstrap_rid": flight.rid,
        }
        await self.router.send_prefill(flight, request, flight.arrays, commit_mark=flight.seen)
