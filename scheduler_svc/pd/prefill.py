"""The PD prefill node's scheduling loop.

A request is prefilled through the Engine's admission; then memsvc sends its KV
to the decode node (``pd_send``) while it waits in ``inflight``. On Success it
is released into the prefix tree and its first token is the reply; on Failed
its KV is freed and it fails with 500. The queue is FIFO, but a prompt that is
not admitted even with this node's pool empty can never be: it fails alone
(400) instead of holding up the queue behind it.
"""

from __future__ import annotations

import logging
from typing import Any

from memsvc.core.errors import InvalidArgumentError, MemsvcError
from memsvc.transfer import KVPoll
from scheduler_svc.core import Req, ReqState
from scheduler_svc.core.swa_budget import full_available_of
from scheduler_svc.engine import Engine
from scheduler_svc.pd.rooms import (
    TRANSFER_POLL_S,
    abort_locally,
    settled_rooms,
    transfer_failed_message,
)

log = logging.getLogger("scheduler_svc")


class PrefillEngine(Engine):
    """Prefill only: every request's KV goes to the decode node, then into the tree here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inflight: dict[int, Req] = {}
        self.stats.transfer_failed = 0

    @property
    def idle(self) -> bool:
        return super().idle and not self.inflight

    def idle_wait_s(self, default: float) -> float:
        return TRANSFER_POLL_S if self.inflight else default

    def settling(self) -> bool:
        """Also with transfers in flight: the router aborts what a flight leaves here
        before it answers the client, and such an abort waits for the decode side's ack
        (:meth:`_sent_anyway`), so a flush right after the last reply can meet it."""
        return not (self.waiting or self.running or self.chunked) and bool(
            self._commands or self.inflight
        )

    async def step(self) -> bool:
        await self._apply_commands()
        did = await self._prefill_round()
        did = await self._poll_inflight() or did
        return did or await self._refuse_unfittable_head()

    async def _refuse_unfittable_head(self) -> bool:
        """Fail the head of the queue alone if it was refused with the pool all free.

        Nothing of this node's holds pages then (nothing running, chunked or in
        flight, every page free or evictable), so no wait can make it fit. Intake
        rejects prompts over the pool's capacity; this is what keeps the FIFO
        queue moving should admission still refuse one.
        """
        if not (self.waiting and self.capacity) or self.running or self.chunked or self.inflight:
            return False
        sizes = self.mem.sizes  # fresh: the prefill round asked, with nothing running
        if full_available_of(sizes) + sizes.evictable < self.capacity:
            return False  # pages held elsewhere (a session ending) may come back
        swa = self.swa_budget_inputs(sizes)  # a hybrid pool: its SWA pool all free too
        if swa is not None and swa[1].available + swa[1].evictable < swa[0].capacity:
            return False
        head = self.waiting[0]
        message = (
            "Request prompt exceeds the KV memory budget of the prefill node: "
            f"input_len={len(head.fill_ids)}, capacity={self.capacity}; it cannot be "
            "admitted even into an empty pool"
        )
        await self._abort(head, message, 400)
        return True

    async def _prefilled(self, prefilled: list[tuple[Req, int]]) -> None:
        """Each request whose prefill completed is sent to its decode side (nothing is
        published here: its KV goes into the tree when the transfer is done)."""
        for req, token in prefilled:
            await self._send(req, token)

    async def _send(self, req: Req, token: int) -> None:
        """``req``'s prefill sampled ``token``: send its KV and the token to the decode side."""
        req.append_token(token)
        self.stats.generated_tokens += 1
        if req.bootstrap_room is None:
            await self._abort(req, "a prefill node needs a bootstrap room", 400)
            return
        try:
            await self.mem.pd_send(
                req.rid,
                req.bootstrap_room,
                req.kv_len,
                token,
                cached_tokens=req.cached_tokens,
                peer_rid=req.bootstrap_rid,
                peer=req.bootstrap_peer,
            )
        except InvalidArgumentError as exc:  # e.g. the room is still held by a dead predecessor
            self.stats.transfer_failed += 1
            await self._abort(req, transfer_failed_message(req, req.bootstrap_room, str(exc)), 500)
            return
        self.inflight[req.bootstrap_room] = req

    async def _poll_inflight(self) -> bool:
        if not self.inflight:
            return False
        done = await settled_rooms(self.mem, list(self.inflight))
        if not done:
            return False
        sent = [r for r in done if r["state"] == KVPoll.SUCCESS]
        reqs = [self.inflight.pop(report["room"]) for report in sent]
        for req in reqs:
            req.check_finished(self.eos_token_ids)  # max_new_tokens is 1 here
        await self._finish_many(reqs)  # their KV into the tree, in one round trip
        for report in done:
            if report["state"] != KVPoll.SUCCESS:
                req = self.inflight.pop(report["room"])
                self.stats.transfer_failed += 1
                why = transfer_failed_message(req, report["room"], report["why"])
                await self._abort(req, why, 500)
        return True

    async def _abort(self, req: Req, message: str, status_code: int) -> None:
        room = req.bootstrap_room
        if room is not None and self.inflight.get(room) is req:
            if await self._sent_anyway(req, room):
                return
            del self.inflight[room]
            try:
                await self.mem.pd_forget([room])
            except MemsvcError:
                abort_locally(self, req, message, status_code)
                raise
        await super()._abort(req, message, status_code)

    async def _sent_anyway(self, req: Req, room: int) -> bool:
        """An abort of ``req`` came while its KV was on the wire (the router aborts
        what a flight leaves here when its decode side ends, which can be before
        the decode side's ack reached memsvc-P). The transfers that ended are
        settled first, as every step does: one that succeeded finishes ``req`` as
        sent, its KV into the tree. One still transferring keeps it in flight until
        it settles (bounded by memsvc's peer timeout). True unless the abort should
        go ahead and free its KV."""
        try:
            await self._poll_inflight()
            if self.inflight.get(room) is not req:
                return True  # it ended with its transfer
            (report,) = await self.mem.pd_status([room])
        except MemsvcError:
            return False
        return report["state"] == KVPoll.TRANSFERRING

    # -- recovery (called by scheduler_svc.recovery; no memsvc calls: the KV is gone) ---

    def requeue_kv_holders(self, why: str) -> list[Req]:
        """memsvc-P lost our KV: every request that held some is prefilled again.

        They go to the front of ``waiting``. One that had sampled its first
        token (its KV was being sent, or about to be) starts over as a fresh
        attempt of the same request: prefilled from its prompt, it samples the
        same token and sends the same room again. The decode side still waits
        for that room, unless it had received part of the pages (that transfer
        then fails: 500) or all of them (the decode node runs the request; the
        router aborts the leftover send here when the request ends). Returns them.
        """
        log.warning("memsvc-P lost the KV (%s): prefilling its holders again", why)
        requeued = []
        for req in list(self.reqs.values()):
            if req.is_finished:
                self.report_ended(req)
            elif req.output_ids:
                fresh = Req(
                    req.rid,
                    req.origin_input_ids,
                    req.sampling_params,
                    priority=req.priority,
                    bootstrap_room=req.bootstrap_room,
                    bootstrap_rid=req.bootstrap_rid,
                    namespace=req.namespace,
                    arrival_time=req.arrival_time,
                )
                self.reqs[req.rid] = fresh
                requeued.append(fresh)
            elif req.state in (ReqState.PREFILLING, ReqState.RUNNING):
                req.reset_for_retract()
                requeued.append(req)
        self.inflight.clear()
        self.running.clear()
        self.chunked = None
        self._requeue_first(requeued)
        return requeued

    def _holds_kv_on_purpose(self) -> list[Req]:
        """A request waiting for its transfer holds its KV on purpose."""
        return list(self.inflight.values())

    def forget_all(self) -> None:
        """Every live request was failed (and reported): drop the PD queues too."""
        super().forget_all()
        self.inflight.clear()
