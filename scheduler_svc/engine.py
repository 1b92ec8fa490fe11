"""The normal-mode scheduling loop: admission, prefill, decode, retract, re-prefill.

One :meth:`Engine.step` is one iteration of SGLang's loop, prefill first::

    commands (submit / abort) ─► prefill round? ──yes──► extend forward ─► merge into running
                                      │ no
                                      ▼
                        decode round: [test retract] decode_step ──fits──► decode forward
                                                        │ no
                                                        ▼
                                retract (memsvc pops victims in our order) ─► re-queue victims,
                                abort the last one if even it does not fit ─► decode_step again

memsvc does the memory side of each step in one round trip (``decode_step``
checks and allocates; ``retract`` releases until the step fits); the pure
core (``scheduler_svc.core``) decides admission, victim order and the
new-token ratio. Commands from clients are applied only between steps, so a
step never sees a request vanish under it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memsvc.client import AsyncMemClient, RetractTarget
from memsvc.core.errors import OutOfRowsError
from memsvc.ops import PoolSizes
from model_svc.client import AsyncModelClient
from scheduler_svc.core import (
    RETRACT_ABORT_MESSAGE,
    RETRACT_ABORT_STATUS,
    AddResult,
    NewTokenRatioTracker,
    PrefillAdder,
    Req,
    ReqState,
    SchedulerConfig,
    retraction_order,
)
from scheduler_svc.core.retract_cost import RetractCostModel

log = logging.getLogger("scheduler_svc")

Emit = Callable[[Req, bool], None]  # (request, finished): new tokens or the final result
GEN_THROUGHPUT_PASSES = 40  # SGLang's decode_log_interval
HOLDS_KV = (ReqState.PREFILLING, ReqState.RUNNING)  # the states in which a request has KV


@dataclass
class EngineStats:
    forward_passes: int = 0
    retract_events: int = 0
    retracted_reqs: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    reprefilled_tokens: int = 0
    offloaded_reqs: int = 0  # victims whose KV went to the host store
    offloaded_tokens: int = 0
    loaded_reqs: int = 0  # ... and came back from it
    loaded_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    aborted_reqs: int = 0
    finished_reqs: int = 0
    last_retracted_reqs: int = 0  # the num_retracted_reqs gauge
    last_ratio_after_retract: float | None = None
    # Wall seconds in each kind of work (where a retract's cost goes). A prefill batch
    # mixing first prefills and re-prefills is split between them by token share.
    prefill_s: float = 0.0
    reprefill_s: float = 0.0  # part of prefill_s
    decode_s: float = 0.0
    retract_s: float = 0.0  # memsvc's retract, offload copies included
    load_s: float = 0.0  # host-store loads on re-admission
    # Hierarchical cache: victims retracted into the tree's host tier, and admitted prefix
    # hits that memsvc loaded from the host / disk tier (re-admissions too).
    tree_retracted_reqs: int = 0
    tree_retracted_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    # ... and admissions undone because such a load failed (a lost or damaged storage page):
    # each matched again, the shorter prefix now, and recomputed the rest.
    cut_prefix_reqs: int = 0
    # SGLang's scheduler gauges (scheduler_svc.metrics): the last prefill batch's prefix-cache
    # hit rate (re-prefills of retracted requests left out), and the decode tokens per second
    # over the last GEN_THROUGHPUT_PASSES decode passes, measured at gen_throughput_at.
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (first admissions)
    last_cache_hit_rate: float = 0.0
    last_gen_throughput: float = 0.0
    gen_throughput_at: float | None = None  # time.monotonic()
    decode_window: tuple[float, int, int] | None = None  # (start, passes, tokens)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def note_prefill(self, hit_tokens: int, computed_tokens: int) -> None:
        self.cached_tokens += hit_tokens
        total = hit_tokens + computed_tokens
        self.last_cache_hit_rate = hit_tokens / total if total else 0.0

    def note_decode(self, num_tokens: int, now: float) -> None:
        start, passes, tokens = self.decode_window or (now, 0, 0)
        passes, tokens = passes + 1, tokens + num_tokens
        if passes >= GEN_THROUGHPUT_PASSES and now > start:
            self.last_gen_throughput = tokens / (now - start)
            self.gen_throughput_at = now
            start, passes, tokens = now, 0, 0
        self.decode_window = (start, passes, tokens)


class Engine:
    def __init__(
        self,
        config: SchedulerConfig,
        mem: AsyncMemClient,
        model: AsyncModelClient,
        emit: Emit,
        *,
        eos_token_ids: tuple[int, ...] = (),
        capacity: int = 0,
    ) -> None:
        self.config = config
        self.capacity = capacity
        self.mem = mem
        self.model = model
        self.emit = emit
        self.eos_token_ids = eos_token_ids
        self.ratio = NewTokenRatioTracker.from_config(config)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.reqs: dict[str, Req] = {}  # every request not yet finished or aborted
        self.stats = EngineStats()
        self._commands: deque[tuple[str, Any]] = deque()
        layout = mem.layout
        self.cost = RetractCostModel(
            bytes_per_token=layout.bytes_per_token if layout else 0,
            page_size=config.page_size,
        )

    # -- commands (applied between steps) --------------------------------------

    def submit(self, req: Req) -> None:
        self._commands.append(("submit", req))

    def abort(self, rid: str) -> bool:
        """Queue an abort; True if ``rid`` is a live request."""
        if rid not in self.reqs and not any(
            kind == "submit" and item.rid == rid for kind, item in self._commands
        ):
            return False
        self._commands.append(("abort", rid))
        return True

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked or self._commands)

    def idle_wait_s(self, default: float) -> float:
        """How long the loop may sleep when a step did nothing (PD: transfers to poll)."""
        return default

    async def _apply_commands(self) -> None:
        while self._commands:
            kind, item = self._commands.popleft()
            if kind == "submit":
                self.reqs[item.rid] = item
                self.waiting.append(item)
            elif item in self.reqs:
                await self._abort(self.reqs[item], "Aborted by the client.", 499)

    # -- the loop ----------------------------------------------------------------

    async def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        await self._apply_commands()
        if await self._prefill_round():
            return True
        if self.running:
            await self._decode_round()
            return True
        if not self.waiting and self.chunked is None:
            self.ratio.reset()
        return False

    # -- prefill -----------------------------------------------------------------

    async def _prefill_round(self) -> bool:
        """Admit (each admitted prefix stays locked), then allocate all of it, then extend.

        Allocating only after the admission loop, as SGLang does, means an
        admitted request's allocation can never evict the prefix that a later
        candidate of the same round would have hit: that prefix is locked by
        then. (A request resumed from the host store loads at once, in the loop.)
        """
        if not self.waiting and self.chunked is None:
            return False
        if len(self.running) >= self.config.max_running_requests and self.chunked is None:
            return False
        if not self.running:
            # Sizes come with every memsvc reply; with no decode traffic they may be
            # stale (another session may have freed pages): ask for fresh ones.
            await self.mem.heartbeat()
        adder = PrefillAdder(
            self.config,
            max(self.mem.sizes.available + self.mem.sizes.evictable, 0),
            self.running,
            self.ratio.current,
            len(self.running),
            self.chunked,
        )
        chunk_len = 0 if self.chunked is None else adder.add_chunked_req(self.chunked).extend_len
        started, num_resumed = await self._admit_waiting(adder)
        cut_before = self.stats.cut_prefix_reqs
        batch = await self._allocate(chunk_len, started)
        if not batch:
            # Resumed from the host store: nothing to compute. An admission whose
            # allocation then failed was undone: no progress (else this spins). One
            # whose prefix load failed (cut) was undone too, but its next match is
            # shorter: progress (a PD prefill node must not take it for unfittable).
            return num_resumed > 0 or self.stats.cut_prefix_reqs > cut_before
        if adder.new_chunked_req in batch:
            self.chunked = adder.new_chunked_req
        first = {id(r) for r in started if not r.retracted_stain}  # hits count on admission
        self.stats.note_prefill(
            sum(r.prefix_len for r in batch if id(r) in first),
            sum(r.extend_len for r in batch if not r.retracted_stain),
        )
        log.debug(
            "prefill %d reqs (%d tokens); running %d, waiting %d, ratio %.3f, budget %s",
            len(batch),
            sum(r.extend_len for r in batch),
            len(self.running),
            len(self.waiting),
            self.ratio.current,
            adder,
        )
        await self._run_extend(batch)
        return True

    async def _admit_waiting(self, adder: PrefillAdder) -> tuple[list[Req], int]:
        """Admit from the head of the queue; returns (started, number resumed from host).

        A started request is PREFILLING with its row and locked prefix, its
        KV not allocated yet. Its prefix match locked that prefix in memsvc:
        what the lock took from the evictable size (the reply says) leaves
        the budget before the candidate is judged. A candidate not admitted
        is unlocked again (its row freed) and ends the round.
        """
        started: list[Req] = []
        num_resumed = 0
        while self.waiting and adder.could_admit(self.waiting[0]):
            req = self.waiting[0]
            if req.host_copy:
                if not await self._resume_from_host(req, adder):
                    break
                self.waiting.popleft()
                num_resumed += 1
                continue
            try:
                row = await self.mem.alloc_row(req.rid)
            except OutOfRowsError:
                break
            before = self.mem.sizes
            prefix_len, tiers = await self._match_prefix(req)
            pinned = _pinned_by_match(before, self.mem.sizes, loads=tiers is not None)
            adder.lock_prefix(min(max(pinned, 0), prefix_len, adder.available_tokens))
            decision = adder.add_one_req(req, prefix_len)
            if not decision.admitted:
                await self.mem.free_row(req.rid)
                break
            req.start_prefill(row, prefix_len, decision.extend_len)
            if tiers is not None:
                req.record_cache_tiers(tiers)
                self.stats.host_hit_tokens += tiers["host"]
                self.stats.storage_hit_tokens += tiers.get("storage", 0)
            self.waiting.popleft()
            started.append(req)
            if decision.result is not AddResult.CONTINUE:
                break
        return started, num_resumed

    @property
    def hierarchical(self) -> bool:
        """memsvc runs the hierarchical cache (host and maybe disk tiers under the tree)."""
        return bool((getattr(self.mem, "hello_info", None) or {}).get("hicache"))

    async def _match_prefix(self, req: Req) -> tuple[int, dict[str, int | str] | None]:
        """Match and lock ``req``'s cached prefix; returns its length and, with the
        hierarchy on, where it came from per tier (host and disk parts are loaded into
        fresh device pages by memsvc, fenced before the extend's ``alloc_extend``)."""
        tokens = req.fill_ids[: req.max_prefix_len]
        if not self.hierarchical:
            return await self.mem.match_prefix(req.rid, tokens), None
        match = await self.mem.match_prefix_tiers(req.rid, tokens)
        tiers: dict[str, int | str] = {"device": match.device_hit, "host": match.host_hit}
        backend = self.mem.hello_info["hicache"].get("storage_backend")
        if match.storage_hit or backend:  # SGLang's keys: storage ones with a storage tier
            tiers["storage"] = match.storage_hit
        if backend:
            tiers["storage_backend"] = backend
        return match.prefix_len, tiers

    async def _allocate(self, chunk_len: int, started: list[Req]) -> list[Req]:
        """Allocate this round's extends in one call; returns the batch to run.

        The budget makes this fit unless the pool moved since it was read
        (another session took pages) or the in-progress chunk (admitted
        whatever the budget) does not fit: then admissions are undone from
        the last one until the rest fits; the chunk, first, goes last and is
        tried again next round. An admission whose prefix load failed in
        memsvc (``cut``) is undone whatever the room (:meth:`_requeue_cut`).
        """
        chunked = self.chunked
        started = list(started)
        while started or chunked is not None:
            items = [(r.rid, r.extend_len) for r in started]
            if chunked is not None:
                items.insert(0, (chunked.rid, chunk_len))
            result = await self.mem.alloc_extend(items)
            if result.fits:
                break
            if result.cut:
                started = await self._requeue_cut(started, result.cut)
                continue
            if not started:
                return []
            req = started.pop()
            await self.mem.free_row(req.rid)
            req.unschedule()
            self.waiting.appendleft(req)
        for req in started:
            if req.retracted_stain:
                self.cost.observe_readmit(len(req.origin_input_ids), req.prefix_len)
            self._mark_readmitted(req)
        if chunked is None:
            return started
        chunked.continue_prefill(chunk_len)
        self.chunked = None  # until the adder says it is (still) chunked
        return [chunked, *started]

    async def _requeue_cut(self, started: list[Req], cut: dict[str, int]) -> list[Req]:
        """Undo the admissions whose matched prefix memsvc cut back (a page loaded for
        it was lost or failed its checksum): they go back to the front of the queue,
        to match again (the good prefix, on the device now) and recompute the rest.
        A miss for them alone: the rest of the batch goes on. Returns the rest."""
        again = [r for r in started if r.rid in cut]
        for req in again:
            await self.mem.free_row(req.rid)
            req.unschedule()
        self.waiting.extendleft(reversed(again))
        self.stats.cut_prefix_reqs += len(again)
        log.warning(
            "cached prefix of %s failed to load (a storage page lost or damaged): recomputing it",
            [(r.rid, cut[r.rid]) for r in again],
        )
        return [r for r in started if r.rid not in cut]

    async def _resume_from_host(self, req: Req, adder: PrefillAdder) -> bool:
        """Re-admit a request whose KV is in the host store: load it back, no prefill."""
        if not adder.add_resumed_req(req):
            return False
        try:
            row = await self.mem.alloc_row(req.rid)
        except OutOfRowsError:
            return False
        started = time.perf_counter()
        fits = (await self.mem.load(req.rid)).fits
        seconds = time.perf_counter() - started
        self.stats.load_s += seconds
        if not fits:
            await self.mem.free_row(req.rid)
            return False
        tokens = req.seq_len - 1
        self.cost.observe_copy(tokens * self.cost.bytes_per_token, seconds)
        req.resume(row)
        self._mark_readmitted(req)
        self.stats.loaded_reqs += 1
        self.stats.loaded_tokens += tokens
        self.running.append(req)
        return True

    def _mark_readmitted(self, req: Req) -> None:
        """A retracted request is back: the thrash guard's cooldown starts now."""
        if req.retracted_stain:
            req.readmit_step = self.stats.forward_passes

    async def _run_extend(self, batch: list[Req]) -> None:
        items = [
            (
                req.row,
                req.prefix_len,
                req.fill_ids[req.prefix_len : req.prefix_len + req.extend_len],
            )
            for req in batch
        ]
        started = time.perf_counter()
        result = await self.model.extend(
            items,
            sampling=[self._sampling(r) for r in batch],
            pool_epoch=self.mem.epoch,
            **_input_logprob_args(batch),
        )
        seconds = time.perf_counter() - started
        num_tokens = sum(req.extend_len for req in batch)
        self.cost.observe_prefill(num_tokens, seconds)
        num_reprefill = sum(req.extend_len for req in batch if req.retracted_stain)
        self.stats.prefill_s += seconds
        self.stats.reprefill_s += seconds * num_reprefill / max(num_tokens, 1)
        self.stats.forward_passes += 1
        for i, (req, token) in enumerate(zip(batch, result.next_token_ids.tolist(), strict=True)):
            count = req.extend_len
            self.stats.prefill_tokens += count
            if req.retracted_stain:
                self.stats.reprefilled_tokens += count
            if result.input_logprobs is not None:
                req.record_input_logprobs(req.prefix_len, result.input_logprobs[i])
            if not req.complete_extend():
                continue  # a chunk: the token sampled after it is not an output
            req.finish_input_logprobs()
            req.record_output_logprob(*_output_logprob(result, i))
            await self._prefilled(req, int(token))

    async def _prefilled(self, req: Req, token: int) -> None:
        """The final prefill round sampled ``token``: start decoding (or finish)."""
        req.append_token(token)
        self.stats.generated_tokens += 1
        if req.check_finished(self.eos_token_ids):
            await self._finish(req)
            return
        req.start_decode()
        # Publish the prompt to the prefix tree (SGLang's cache_unfinished_req):
        # a retracted request later finds it there and recomputes only its tail.
        await self.mem.cache_unfinished(req.rid, req.fill_ids[: req.kv_len])
        self.running.append(req)
        self.emit(req, False)

    # -- decode ------------------------------------------------------------------

    async def _decode_round(self) -> None:
        retracted = False
        if self.config.is_test_retract_step(self.stats.forward_passes) and len(self.running) > 1:
            await self._retract(kv_full=False)
            retracted = True
        while self.running:
            step = await self.mem.decode_step([r.row for r in self.running])
            if step.fits:
                break
            await self._retract(kv_full=True)
            retracted = True
        if not self.running:
            return
        if not retracted:
            self.ratio.decay_step()
        batch = list(self.running)
        started = time.perf_counter()
        result = await self.model.decode(
            [r.row for r in batch],
            [r.seq_len for r in batch],
            [r.output_ids[-1] for r in batch],
            sampling=[self._sampling(r) for r in batch],
            pool_epoch=self.mem.epoch,
        )
        self.stats.decode_s += time.perf_counter() - started
        self.stats.forward_passes += 1
        self.stats.note_decode(len(batch), time.monotonic())
        for i, (req, token) in enumerate(zip(batch, result.next_token_ids.tolist(), strict=True)):
            req.append_token(int(token))
            req.record_output_logprob(*_output_logprob(result, i))
            self.stats.generated_tokens += 1
            if req.check_finished(self.eos_token_ids):
                self.running.remove(req)
                await self._finish(req)
            else:
                self.emit(req, False)

    async def _retract(self, *, kv_full: bool) -> None:
        """Retract from the running batch in victim order (memsvc stops when the step fits)."""
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

    # -- endings -----------------------------------------------------------------

    async def _finish(self, req: Req) -> None:
        """Cache the finished request's KV in the tree and report the result."""
        await self.mem.release(req.rid, req.fill_ids[: req.kv_len], is_insert=True)
        self.stats.finished_reqs += 1
        self.reqs.pop(req.rid, None)
        self.emit(req, True)

    async def _abort(self, req: Req, message: str, status_code: int) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        holds_kv = req.row is not None and req.state in HOLDS_KV
        host_copy = req.host_copy and req.is_retracted
        req.abort(message, status_code)
        if holds_kv:
            await self.mem.free_row(req.rid)
        if host_copy:  # retracted to the host store: its parked KV goes too
            await self.mem.host_discard(req.rid)
            req.host_copy = False
        self.stats.aborted_reqs += 1
        self.reqs.pop(req.rid, None)
        self.emit(req, True)

    # -- repairs between steps (scheduler_svc.recovery, the service) -------------

    def requeue_kv_holders(self, why: str) -> list[Req]:
        """memsvc lost our KV (``why``): every request that held some is retracted and
        goes to the front of ``waiting``, in the order of ``reqs``; returns them.

        Requests that finished (or were aborted) in the failed step before their
        release reached memsvc are reported now: their output is complete. A
        retracted request whose KV waited in the host store is re-prefilled.
        Nothing is sent to memsvc: the KV is gone. The PD engines have their own.
        """
        requeued = []
        for req in list(self.reqs.values()):
            if req.is_finished:
                self.report_ended(req)
            elif req.state in HOLDS_KV:
                req.reset_for_retract()
                requeued.append(req)
            elif req.host_copy:
                # Offloaded by a retract: its host-store copy went with the old session
                # (or the old memsvc), so it is re-prefilled instead of loaded back.
                req.host_copy = False
        self.running.clear()
        self.chunked = None
        self._requeue_first(requeued)
        return requeued

    async def rollback_torn(self) -> list[Req]:
        """Undo the requests a failed step left half-scheduled; returns them.

        Consistent between steps: a RUNNING request in ``running``, the chunked
        request with no chunk in flight, queued requests without a row, and
        what :meth:`_holds_kv_on_purpose` names. Anything else that holds KV
        has its row freed in memsvc and goes to the front of ``waiting``.
        Requests that finished in the failed step are reported.
        """
        keep = {id(r) for r in self.running if r.state is ReqState.RUNNING}
        keep |= {id(r) for r in self._holds_kv_on_purpose()}
        chunked = self.chunked
        between_chunks = chunked is not None and chunked.state is ReqState.PREFILLING
        if between_chunks and not chunked.extend_in_flight:
            keep.add(id(chunked))
        torn = []
        for req in list(self.reqs.values()):
            if req.is_finished:
                self.report_ended(req)
            elif req.state in HOLDS_KV and id(req) not in keep:
                await self.mem.free_row(req.rid)
                req.reset_for_retract()
                torn.append(req)
        self.running[:] = [r for r in self.running if id(r) in keep]
        if self.chunked is not None and id(self.chunked) not in keep:
            self.chunked = None
        self._requeue_first(torn)
        return torn

    def _holds_kv_on_purpose(self) -> list[Req]:
        """Requests outside ``running`` that hold KV between steps (none here; PD prefill:
        those waiting for their transfer)."""
        return []

    def report_ended(self, req: Req) -> None:
        """``req`` ended (finished or aborted) outside a step: it leaves ``reqs`` and every
        queue, and its final result is emitted. Nothing is sent to memsvc."""
        self.reqs.pop(req.rid, None)
        for queue in (self.running, self.waiting):
            if req in queue:
                queue.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.emit(req, True)

    def fail_request(self, req: Req, message: str, status_code: int) -> None:
        """End ``req`` with an error between steps and report it; for a request that
        holds no KV (nothing is sent to memsvc)."""
        req.abort(message, status_code)
        self.stats.aborted_reqs += 1
        self.report_ended(req)

    def fail_all(self, message: str, status_code: int) -> None:
        """A fault that cannot be repaired: end every live request with ``message`` (one
        already finished keeps its result), report each, and empty every queue. The
        KV they held is reclaimed by ending the memsvc session, not here."""
        for req in list(self.reqs.values()):
            if not req.is_finished:
                req.abort(message, status_code)
            self.reqs.pop(req.rid, None)
            self.emit(req, True)
        self.forget_all()

    def forget_all(self) -> None:
        """Every live request was failed and reported: drop every queue."""
        self.waiting.clear()
        self.running.clear()
        self.chunked = None

    def _requeue_first(self, reqs: list[Req]) -> None:
        """Put ``reqs`` at the front of ``waiting``, in order; the rest keep theirs."""
        if not reqs:
            return
        again = {r.rid for r in reqs}
        rest = [r for r in self.waiting if r.rid not in again]
        self.waiting.clear()
        self.waiting.extend([*reqs, *rest])

    def _sampling(self, req: Req) -> dict[str, Any]:
        """The worker's ``SamplingSpec`` for ``req``'s next token: its record's ``draw``
        as it came (a seed of 0 or none: one from the rid), and what this step decides."""
        draw = req.sampling_params.draw
        spec = {**draw, "seed": draw.get("seed") or _seed_from_rid(req.rid)}
        if req.return_logprob:
            spec["logprobs"] = True
            spec["top_logprobs_num"] = req.top_logprobs_num
        suppress = req.suppressed_token_ids(self.eos_token_ids)
        if suppress:
            spec["suppress_token_ids"] = suppress
        return spec


def _input_logprob_args(batch: list[Req]) -> dict[str, Any]:
    """The extend's ``logprob_starts`` / ``next_token_ids``, if a request wants its
    prompt's logprobs (each from ``logprob_start_len``, relative to its round)."""
    if not any(req.wants_input_logprobs for req in batch):
        return {}
    starts, after = [], []
    for req in batch:
        end = req.prefix_len + req.extend_len
        if req.wants_input_logprobs:
            starts.append(max(req.logprob_start_len - req.prefix_len, 0))
        else:
            starts.append(req.extend_len)  # none
        after.append(req.fill_ids[end] if end < len(req.fill_ids) else -1)
    return {"logprob_starts": starts, "next_token_ids": after}


def _output_logprob(result: Any, index: int) -> tuple[float | None, Any]:
    """The sampled token's logprob and top-k (``[[logprob, id], ...]``) in ``result``."""
    logprobs = getattr(result, "logprobs", None)
    tops = getattr(result, "top_logprobs", None)
    top = tops[index] if tops is not None else None
    if top is not None:
        top = [[value, token] for value, token in zip(top[0], top[1], strict=True)]
    return (logprobs[index] if logprobs is not None else None), top


def _pinned_by_match(before: PoolSizes, after: PoolSizes, *, loads: bool) -> int:
    """Tokens a prefix match took from available + evictable: what its lock pinned and,
    with the hierarchy on, the fresh device pages its host / disk part was loaded into."""
    pinned = before.evictable - after.evictable
    if loads:
        pinned += before.available - after.available
    return pinned


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


def _seed_from_rid(rid: str) -> int:
    """A stable per-request seed for requests that chose none (so equal prompts can differ)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") >> 1
