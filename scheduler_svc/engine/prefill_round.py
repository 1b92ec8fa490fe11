"""The prefill round: admit from the waiting queue, allocate, run the extend.

Admission is the pure core's (:class:`~scheduler_svc.core.PrefillAdder`
decides against memsvc's sizes); each admitted prefix stays locked in memsvc
until the whole round is allocated in one ``alloc_extend``. A request whose
KV waits in the host store is loaded back instead of prefilled. A request
whose prefill is complete publishes its prompt to the prefix tree and joins
the running batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from memsvc.core.errors import OutOfRowsError
from memsvc.ops import PoolSizes
from scheduler_svc.core import AddResult, PrefillAdder, Req
from scheduler_svc.engine.base import EngineBase, output_logprob

log = logging.getLogger("scheduler_svc")


class PrefillRound(EngineBase):
    """The engine's prefill round (see the module docstring)."""

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
            req.record_output_logprob(*output_logprob(result, i))
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


def _pinned_by_match(before: PoolSizes, after: PoolSizes, *, loads: bool) -> int:
    """Tokens a prefix match took from available + evictable: what its lock pinned and,
    with the hierarchy on, the fresh device pages its host / disk part was loaded into."""
    pinned = before.evictable - after.evictable
    if loads:
        pinned += before.available - after.available
    return pinned
