"""The decode round: check decode memory, retract until the step fits, decode.

memsvc checks and allocates one slot per running request in one round trip
(``decode_step``); when the step does not fit, ``retract`` releases victims
in the order the pure core chose (least worth keeping last) until it does,
each victim's KV going where :meth:`DecodeRound._retract_targets` says (a
:class:`~memsvc.protocol.RetractTarget`). The victims go back to a queue to
be re-admitted; the last request is aborted if even it alone does not fit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from memsvc.client import RetractTarget
from scheduler_svc.core import (
    RETRACT_ABORT_MESSAGE,
    RETRACT_ABORT_STATUS,
    Req,
    retraction_order,
)
from scheduler_svc.engine.base import EngineBase, output_logprob

log = logging.getLogger("scheduler_svc")


class DecodeRound(EngineBase):
    """The engine's decode round and retract (see the module docstring)."""

    async def _decode_round(self) -> None:
        retracted = False
        if self.config.is_test_retract_step(self.stats.forward_passes) and len(self.running) > 1:
            await self._drop_ahead()
            await self._retract(kv_full=False)
            retracted = True
        while self.running:
            # Rows whose slot for this step the previous step reserved ahead need none.
            need = [r.row for r in self.running if not r.slot_reserved]
            if not need or (await self.mem.decode_step(need)).fits:
                break
            if len(need) < len(self.running):  # give the slots reserved ahead back first
                await self._drop_ahead()
                continue
            await self._retract(kv_full=True)
            retracted = True
        for req in self.running:
            req.slot_reserved = False
        if not self.running:
            return
        if not retracted:
            self.ratio.decay_step()
        batch = list(self.running)
        result = await self._forward_and_reserve(batch)
        self.stats.forward_passes += 1
        self.stats.decode_passes += 1
        self.stats.decode_pass_reqs += len(batch)
        self.stats.note_decode(len(batch), time.monotonic())
        finished = []
        for i, (req, token) in enumerate(zip(batch, result.next_token_ids.tolist(), strict=True)):
            req.append_token(int(token))
            req.record_output_logprob(*output_logprob(result, i))
            self.stats.generated_tokens += 1
            if req.check_finished(self.eos_token_ids):
                self.running.remove(req)
                finished.append(req)
            else:
                self.emit(req, False)
        await self._finish_many(finished)

    # -- the overlap schedule ----------------------------------------------------

    async def _forward_and_reserve(self, batch: list[Req]) -> Any:
        """Run the decode forward pass of ``batch``; returns its result.

        With the overlap schedule (on unless ``--disable-overlap-schedule``),
        while the worker runs this step memsvc reserves the next step's slot
        for each request of the batch that may still be running then: the
        next round's ``decode_step`` is then done before it starts. A request
        that finishes in this step hands its reserved slot back with its
        release (its token ids stop one short of its KV); a round that needs
        more room than is free first gives every reserved slot back
        (:meth:`_drop_ahead`), so retract decides exactly as without overlap.
        """
        ahead = self._ahead_candidates(batch)
        forward = self._timed_decode(batch)
        if not ahead and self.journal is None:
            return await forward
        outcome = await asyncio.gather(
            forward, self._commit_and_reserve(ahead), return_exceptions=True
        )
        result, reserved = outcome
        if reserved is not None and not isinstance(reserved, BaseException) and reserved.fits:
            for req in ahead:
                req.slot_reserved = True
            self.stats.reserved_ahead_steps += 1
        # Both calls are done: nothing is left running. memsvc's failure first: a forward
        # that failed beside it most likely read a pool memsvc no longer vouches for.
        for failure in (reserved, result):
            if isinstance(failure, BaseException):
                raise failure
        return result

    async def _commit_and_reserve(self, ahead: list[Req]) -> Any:
        """memsvc's side of a decode step, while the worker runs it: the journal's commit
        of the last step (scheduler_svc.adopt), then the next step's slots (None: none)."""
        await self.commit_journal()
        return await self.mem.decode_step([r.row for r in ahead]) if ahead else None

    async def _timed_decode(self, batch: list[Req]) -> Any:
        """The worker's decode forward pass of ``batch``, its wall time in ``decode_s``."""
        started = time.perf_counter()
        try:
            return await self.model.decode(
                [r.row for r in batch],
                [r.seq_len for r in batch],
                [r.output_ids[-1] for r in batch],
                sampling=[self._sampling(r) for r in batch],
                pool_epoch=self.mem.epoch,
            )
        finally:
            seconds = time.perf_counter() - started
            self.stats.decode_s += seconds
            self.cost.observe_decode_step(seconds)

    def _ahead_candidates(self, batch: list[Req]) -> list[Req]:
        """The requests of ``batch`` to reserve the next step's slot for while it runs:
        none with the overlap off or before a testing retract; else those not sure
        to finish in this step (``max_new_tokens`` reached)."""
        config = self.config
        if config.disable_overlap_schedule or config.is_test_retract_step(
            self.stats.forward_passes + 1
        ):
            return []
        return [r for r in batch if len(r.output_ids) + 1 < r.sampling_params.max_new_tokens]

    async def _drop_ahead(self) -> None:
        """Give back every slot reserved ahead, in one round trip: each such running
        request publishes its written KV (``cache_unfinished``, one position short
        of its row), which frees the reserved slot."""
        reserved = [r for r in self.running if r.slot_reserved]
        if not reserved:
            return
        await self.commit_journal()  # memsvc's KV changes: the records first
        await self.mem.cache_unfinished_many([(r.rid, r.fill_ids[: r.kv_len]) for r in reserved])
        for req in reserved:
            req.slot_reserved = False
        self.stats.dropped_ahead_reqs += len(reserved)

    # -- retract ---------------------------------------------------------------

    async def _retract(self, *, kv_full: bool) -> None:
        """Retract from the running batch in victim order (memsvc stops when the step fits)."""
        await self.commit_journal()  # memsvc's KV changes: the records first
        order = retraction_order(self.running, self.config, self.stats.forward_passes, self.cost)
        ordered = [self.running[i] for i in order]
        old_ratio = self.ratio.current
        sizes_before = self.mem.sizes
        log.debug(
            "retract order (keep first): %s",
            [(r.rid, len(r.output_ids), len(r.origin_input_ids)) for r in ordered],
        )
        targets = self._retract_targets(ordered)
        started = time.perf_counter()
        reply = await self.mem.retract(
            [r.row for r in ordered], targets, token_ids=_tree_token_ids(ordered, targets)
        )
        self.stats.retract_s += time.perf_counter() - started
        offloaded = {
            r.rid
            for r, target in zip(ordered, targets, strict=True)
            if target is RetractTarget.HOST_ENTRY
        }
        into_tree = set(getattr(reply, "to_tree", ()))
        by_rid = {r.rid: r for r in ordered}
        for rid in reply.retracted:
            req = by_rid[rid]
            self.running.remove(req)
            self.stats.retracted_reqs += 1
            self.stats.retracted_input_tokens += len(req.origin_input_ids)
            self.stats.retracted_output_tokens += len(req.output_ids)
            host_copy = rid in offloaded
            if host_copy:
                self.stats.offloaded_reqs += 1
                self.stats.offloaded_tokens += req.seq_len - 1
            elif rid in into_tree:  # its KV is in the tree: re-admission is a prefix hit
                self.stats.tree_retracted_reqs += 1
                self.stats.tree_retracted_tokens += req.seq_len - 1
            req.reset_for_retract()
            req.host_copy = host_copy
            await self._requeue_retracted(req)
        for rid in reply.offload_failed:
            req = by_rid[rid]
            self.running.remove(req)
            self.stats.retracted_reqs += 1
            req.reset_for_retract()
            await self._offload_failed(req)
        if reply.last_does_not_fit and self.running:
            last = self.running[0]
            log.warning("retract_decode: aborted last request %s due to OOM", last.rid)
            await self._abort(last, RETRACT_ABORT_MESSAGE, RETRACT_ABORT_STATUS)
        self.stats.retract_events += 1
        self.stats.last_retracted_reqs = len(reply.retracted)
        new_ratio = self.ratio.on_retract(self.running)
        self.stats.last_ratio_after_retract = new_ratio
        gained = self.mem.sizes.available - sizes_before.available
        head = "KV cache pool is full. Retract requests. " if kv_full else "Testing retraction. "
        tail = f", #new_token_ratio: {old_ratio:.4f} -> {new_ratio:.4f}" if kv_full else ""
        log.warning(
            "%s#retracted_reqs: %d, #new_tokens_gained: %d%s",
            head,
            len(reply.retracted),
            gained,
            tail,
        )

    def _retract_targets(self, ordered: list[Req]) -> list[RetractTarget]:
        """Per request of the victim order, where its KV goes if retracted.

        FREE (re-prefilled), HOST_ENTRY (memsvc's private host-store entry, loaded
        back whole on re-admission), or, with the hierarchy on, TREE: inserted
        into the radix tree and backed up to its host tier, so that its own
        re-admission and any request sharing its prefix hit it.
        """
        mode = self.config.retract_mode
        kept = RetractTarget.TREE if self.hierarchical else RetractTarget.HOST_ENTRY
        if mode != "auto":
            return [kept if mode == "offload" else RetractTarget.FREE] * len(ordered)
        # Victims are popped from the end: decide in that order, so host-store room
        # goes to the first ones retracted. The host tier makes room by LRU eviction:
        # all of it is there to take.
        room = self.mem.sizes.host_free
        if self.hierarchical:
            room = int(self.mem.hello_info["hicache"].get("host_capacity_bytes", 0))
        choices = self.cost.choose_offload(ordered[::-1], room)
        return [kept if c else RetractTarget.FREE for c in choices[::-1]]

    async def _requeue_retracted(self, req: Req) -> None:
        """Normal mode: back to the tail of the waiting queue (re-prefill or host-store load)."""
        self.waiting.append(req)

    async def _offload_failed(self, req: Req) -> None:
        """The host store could not take the victim: normal mode re-prefills it instead."""
        await self._requeue_retracted(req)


def _tree_token_ids(
    ordered: list[Req], targets: list[RetractTarget]
) -> list[list[int] | None] | None:
    """``retract``'s ``token_ids``: those of each TREE victim (whose KV is written: all
    but the last token, ``kv_len`` of them), None for the others; None if none is TREE."""
    if RetractTarget.TREE not in targets:
        return None
    return [
        r.fill_ids[: r.kv_len] if t is RetractTarget.TREE else None
        for r, t in zip(ordered, targets, strict=True)
    ]
