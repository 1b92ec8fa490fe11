"""The service's side of moved requests (scheduler_svc.pd.migrate; issue 32, part 2).

A mixin of :class:`~scheduler_svc.service.SchedulerService`: on the node a
request moves to, ``migrate_in`` (checked here, then queued for the decode
engine as a retracted request whose KV is on its way); on the node it moved
from, one relay task per moved request forwards the peer's replies to the
request's client, keeping the stream's offsets (the peer streams from the first
token it generates), and caches the result as any other. A client's ``abort``
of a moved request goes to the peer, whose ``done`` is relayed.

A client that asked to follow moves (``follow_moves``: the PD router) is not
relayed to: it gets a ``moved`` reply naming the peer and re-submits the request
there, where it attaches to the moved request (same client and fingerprint,
carried by ``migrate_in``) and the stream restarts at offset 0. This node then
holds nothing of it, and the ``moved`` reply stays in the result cache for a
re-submission here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from memsvc import protocol as wire
from memsvc.reply_cache import ReplyCache
from scheduler_svc.core import Req, SamplingParams, check_fits
from scheduler_svc.intake import DRAINING
from scheduler_svc.pd.migrate import LOST_MESSAGE, Relay
from scheduler_svc.replies import Waiter, error_reply

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine

log = logging.getLogger("scheduler_svc")


class MovedRequests:
    """``migrate_in`` and the relays (see the module docstring)."""

    engine: Engine
    mode: str
    capacity: int
    page_size: int
    max_context_len: int
    vocab_size: int
    _waiters: dict[str, Waiter]
    _finished: ReplyCache[str, tuple[str, str, bytes]]
    _outbox: asyncio.Queue[list[bytes]]
    _relays: set[asyncio.Task]
    draining: bool

    if TYPE_CHECKING:

        def _stop_decoder(self, token_ids: list[int]) -> str: ...

        def _refusal(
            self, input_ids: list[int], msg: Any, output_ids: list[int] | None = None
        ) -> list[bytes] | None: ...

    def _migrate_in(self, identity: bytes, msg: Any) -> list[bytes] | None:
        """Another decode node moves a retracted request here (scheduler_svc.pd.migrate):
        it waits for its KV as a retracted request does; its replies go to that node."""
        if self.mode != "decode":
            message = f"a {self.mode} node does not take moved requests (decode nodes do)"
            return error_reply(msg.op_id, "bad_request", message, 400)
        if self.draining:
            return error_reply(msg.op_id, "unavailable", DRAINING, 503)
        if msg.rid in self._waiters or msg.rid in self.engine.reqs:
            message = f"request {msg.rid!r} is already here"
            return error_reply(msg.op_id, "duplicate_rid", message, 400)
        input_ids, output_ids = msg.input_ids.tolist(), msg.output_ids.tolist()
        refused = self._refusal(input_ids, msg, output_ids)
        if refused is not None:
            return refused
        check_fits(len(input_ids) + msg.sampling.max_new_tokens, self.capacity, self.page_size)
        req = Req(
            msg.rid,
            input_ids,
            SamplingParams.of(msg.sampling.model_dump()),
            priority=msg.priority,
            output_ids=output_ids,
            bootstrap_room=msg.room,
            namespace=msg.namespace,
            stop_decoder=self._stop_decoder if msg.sampling.stop else None,
        )
        req.arrive_migrated(msg.retractions, msg.cached_tokens)
        self._waiters[msg.rid] = Waiter(
            identity,
            msg.op_id,
            True,
            time.monotonic(),
            sent=len(output_ids),  # the sender has those: stream from the first new one
            # the request's own client may re-submit (follow the move) or abort it here
            fingerprint=msg.fingerprint or f"migrated:{msg.room}",
            client=msg.owner or msg.client,
        )
        self.engine.accept_migrated(req)
        return None

    # -- this node's requests moved to the peer: their replies, relayed ---------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)

    def _relay(self, req: Req) -> None:
        """``req`` moved to the peer decode node: a client that follows moves is told where
        (it re-submits the request there); any other one has its replies relayed."""
        waiter = self._waiters.get(req.rid)
        migration = self.engine.migration
        if waiter is None or not waiter.follow_moves or migration is None:
            self._spawn(self._forward(req.rid))
            return
        del self._waiters[req.rid]
        migration.finished(req.rid)  # what the peer still sends for it here is dropped
        self.engine.stats.migrated_handed_off_reqs += 1
        header = {"ok": True, "type": "moved", "rid": req.rid, "peer": migration.address}
        # kept as its result: the same client re-submitting it here is told again
        (packed,) = wire.pack(header)
        self._finished.put(req.rid, (waiter.client, waiter.fingerprint, packed), len(packed))
        if waiter.identity is not None:
            reply = wire.pack({**header, "op_id": waiter.op_id})
            self._outbox.put_nowait([waiter.identity, *reply])

    async def _forward(self, rid: str) -> None:
        """The peer's replies for ``rid`` to the request's client: the stream keeps its
        offsets (the peer sends from the first token it generates), the result is cached
        here as any other."""
        migration = self.engine.migration
        relay = migration.relays.get(rid) if migration is not None else None
        if relay is None:
            return
        try:
            while True:
                header = await relay.next_reply()
                waiter = self._waiters.get(rid)
                if header is None or waiter is None:  # the peer is gone, or so is our client
                    if waiter is not None:
                        self._relay_lost(rid, waiter, migration.address)
                    return
                if header.get("type") == "chunk":
                    self._relay_chunk(relay, waiter, header)
                    continue
                header = {**header, "op_id": waiter.op_id}
                if header.get("type") == "done" and isinstance(header.get("meta_info"), dict):
                    waiter_s = time.monotonic() - waiter.started
                    header["meta_info"] = {**header["meta_info"], "e2e_latency": waiter_s}
                del self._waiters[rid]
                (packed,) = wire.pack(header)
                if waiter.identity is not None:
                    self._outbox.put_nowait([waiter.identity, packed])
                if header.get("ok"):
                    self._finished.put(
                        rid, (waiter.client, waiter.fingerprint, packed), len(packed)
                    )
                return
        finally:
            migration.finished(rid)

    def _relay_chunk(self, relay: Relay, waiter: Waiter, chunk: dict[str, Any]) -> None:
        tokens = chunk.get("token_ids") or []
        if chunk.get("offset") != len(relay.tokens):
            log.warning(
                "relayed %s: a chunk at %s, expected %d",
                relay.rid,
                chunk.get("offset"),
                len(relay.tokens),
            )
            return
        relay.tokens.extend(tokens)
        if not waiter.stream or waiter.identity is None or len(relay.tokens) <= waiter.sent:
            return
        out = {
            **chunk,
            "op_id": waiter.op_id,
            "token_ids": relay.tokens[waiter.sent :],
            "offset": waiter.sent,
        }
        waiter.sent = len(relay.tokens)
        self._outbox.put_nowait([waiter.identity, *wire.pack(out)])

    def _relay_lost(self, rid: str, waiter: Waiter, peer: str) -> None:
        del self._waiters[rid]
        if waiter.identity is not None:
            message = LOST_MESSAGE.format(rid=rid, peer=peer)
            self._outbox.put_nowait(
                [waiter.identity, *error_reply(waiter.op_id, "unavailable", message, 503)]
            )
