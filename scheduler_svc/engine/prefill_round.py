"""The prefill round: admit from the waiting queue, allocate, run the extend.

Admission is the pure core's (:class:`~scheduler_svc.core.PrefillAdder`
decides against memsvc's sizes). A round's admissions take two memsvc round
trips: one ``admit`` opens, matches and locks the head of the queue (as many
as the budget could take if nothing of them were cached, and the next), the
adder judges the replies in queue order exactly as if each had been matched
alone, and one ``alloc_extend`` allocates the admitted ones and closes the
rest. Where prefix hits leave room for more, another ``admit`` follows
(:meth:`PrefillRound._candidates`). A request whose KV waits in the host
store is loaded back instead of prefilled. After the extend, the requests
whose prefill is complete publish their prompts to the prefix tree in one
``cache_unfinished_many`` and join the running batch; those that finished
at once are released in one ``release_many``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from memsvc.core.errors import OutOfRowsError
from memsvc.ops import AdmitMatch, AdmitResult, PoolSizes
from memsvc.sessions import NotOwnerError
from scheduler_svc.core import AddResult, PrefillAdder, Req
from scheduler_svc.core.admission import floor_page
from scheduler_svc.core.swa_budget import SwaPrefillGate, full_available_of
from scheduler_svc.engine.base import EngineBase, output_logprob

log = logging.getLogger("scheduler_svc")

# Prompt tokens one admit may carry (8 bytes each): well under memsvc's message limit.
ADMIT_MAX_TOKENS = 1 << 21

# Candidates sent in one admit, its reply, and whether the last is one the no-hit
# estimate refused (then, if it goes in, prefix hits made room for more).
Admitting = tuple[list[Req], AdmitResult, bool]


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
        adder, chunk_len = self._new_adder(self.mem.sizes)
        first = None
        if not self.running:
            # Sizes come with every memsvc reply; with no decode traffic they may be
            # stale (another session may have freed pages). The round's first admit
            # reads them fresh (its reply has the sizes before it opened anything) and
            # the budget is made again from those; with no admit to send, ask.
            batch, refused = self._candidates(adder)
            if batch:
                first = (batch, await self._admit(batch), refused)
                adder, chunk_len = self._new_adder(first[1].before)
            else:
                await self.mem.heartbeat()
                adder, chunk_len = self._new_adder(self.mem.sizes)
        started, num_resumed, rejected = await self._admit_waiting(adder, first)
        cut_before = self.stats.cut_prefix_reqs
        batch = await self._allocate(chunk_len, started, rejected)
        if not batch:
            # Resumed from the host store: nothing to compute. An admission whose
            # allocation then failed was undone: no progress (else this spins). One
            # whose prefix load failed (cut) was undone too, but its next match is
            # shorter: progress (a PD prefill node must not take it for unfittable).
            return num_resumed > 0 or self.stats.cut_prefix_reqs > cut_before
        if adder.new_chunked_req in batch:
            self.chunked = adder.new_chunked_req
        first_ids = {id(r) for r in started if not r.retracted_stain}  # hits count on admission
        self.stats.note_prefill(
            sum(r.prefix_len for r in batch if id(r) in first_ids),
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

    def _new_adder(self, sizes: PoolSizes) -> tuple[PrefillAdder, int]:
        """The round's budget on ``sizes``, with the in-progress chunk (if any) added
        first; returns it and the chunk's length (0: the SWA budget parked it).

        A hybrid pool adds the SWA gate on the SWA pool's sizes; the total and
        current budgets are then the full pool's (SGLang 0.5.23's SWAPrefillBudget).
        """
        swa = self.swa_budget_inputs(sizes)
        available = sizes.available if swa is None else full_available_of(sizes)
        adder = PrefillAdder(
            self.config,
            max(available + sizes.evictable, 0),
            self.running,
            self.ratio.current,
            len(self.running),
            self.chunked,
            swa=None if swa is None else SwaPrefillGate(*swa),
        )
        chunk_len = 0 if self.chunked is None else adder.add_chunked_req(self.chunked).extend_len
        return adder, chunk_len

    async def _admit_waiting(
        self, adder: PrefillAdder, first: Admitting | None = None
    ) -> tuple[list[Req], int, list[str]]:
        """Admit from the head of the queue; returns (started, number resumed from host,
        rids opened but not admitted: the round's ``alloc_extend`` closes them).

        ``first``: an admit already sent for this round. A started request is
        PREFILLING with its row and locked prefix, its KV not allocated yet.
        """
        started: list[Req] = []
        rejected: list[str] = []
        num_resumed = 0
        pending = first
        hits = None
        while True:
            if pending is None:
                if not (self.waiting and adder.could_admit(self.waiting[0])):
                    break
                req = self.waiting[0]
                if req.host_copy:
                    if not await self._resume_from_host(req, adder):
                        break
                    self.waiting.popleft()
                    num_resumed += 1
                    continue
                batch, refused = self._candidates(adder, hits)
                pending = (batch, await self._admit(batch), refused)
            batch, reply, refused = pending
            pending = None
            if not self._judge(adder, batch, reply, started, rejected):
                break
            if refused:  # prefix hits made room past the no-hit estimate: the next
                hits = len(started) * 2 + 8  # batch is estimated with whole hits, bounded
        return started, num_resumed, rejected

    def _candidates(self, adder: PrefillAdder, hits: int | None = None) -> tuple[list[Req], bool]:
        """The head of ``waiting`` for one admit: up to a request resumed from the host
        store, while a scratch copy of the budget goes on; the first one it refuses is
        in too (its real match decides; the flag returned says it is the last). Empty
        if the head is refused or resumed from the host store.

        The scratch budget charges each candidate as if nothing of it were cached: a
        real match costs no more, so no candidate past the first the adder refuses is
        opened, and the round matches exactly what one match at a time would. With
        ``hits``, at most that many candidates, each charged as if all it may match
        were cached (fewer round trips when hits make room; a candidate past the first
        refused may be matched, then closed unadmitted by the round's ``alloc_extend``).
        """
        sim = adder.scratch()
        batch: list[Req] = []
        tokens = 0
        for req in self.waiting:
            if req.host_copy or not sim.could_admit(req):
                break
            tokens += req.max_prefix_len
            if batch and (tokens > ADMIT_MAX_TOKENS or len(batch) == hits):
                break
            batch.append(req)
            guess = 0 if hits is None else floor_page(max(req.max_prefix_len, 0), adder.page_size)
            decision = sim.add_one_req(req, guess)
            if decision.result is not AddResult.CONTINUE:
                return batch, not decision.admitted
        return batch, False

    async def _admit(self, batch: list[Req]) -> AdmitResult:
        """Open, match and lock ``batch``'s prefixes in memsvc, in one round trip."""
        items = [(r.rid, r.fill_ids[: r.max_prefix_len]) for r in batch]
        kwargs: dict[str, Any] = {}
        if self.hierarchical:  # memsvc weighs each load against recomputing it
            kwargs["recompute_s_per_token"] = self.cost.recompute_s_per_token()
        if any(r.namespace for r in batch):  # None: all in the default namespace
            kwargs["namespaces"] = [r.namespace for r in batch]
        return await self.mem.admit(items, **kwargs)

    def _judge(
        self,
        adder: PrefillAdder,
        batch: list[Req],
        reply: AdmitResult,
        started: list[Req],
        rejected: list[str],
    ) -> bool:
        """Run the adder over one admit's candidates in queue order, as if each had been
        matched alone; returns whether the next candidate may be tried.

        What a candidate's lock pinned (memsvc read it around that match) leaves
        the budget before it is judged. The first not admitted ends the round:
        it and every candidate opened after it go to ``rejected``.
        """
        opened = [r.rid for r in batch[: len(reply.matches)]]
        for i, (req, match) in enumerate(zip(batch, reply.matches, strict=False)):
            if not adder.could_admit(req):
                rejected.extend(opened[i:])
                return False
            adder.lock_prefix(
                min(max(match.pinned, 0), match.prefix_len, adder.available_tokens),
                getattr(match, "swa_pinned", 0),  # a hybrid pool's SWA tail, if reported
            )
            decision = adder.add_one_req(req, match.prefix_len)
            if not decision.admitted:
                rejected.extend(opened[i:])
                return False
            req.start_prefill(match.row, match.prefix_len, decision.extend_len)
            if self.hierarchical:
                tiers = self._tiers(match)
                req.record_cache_tiers(tiers)
                self.stats.host_hit_tokens += tiers["host"]
                self.stats.storage_hit_tokens += tiers.get("storage", 0)
            self.waiting.popleft()
            started.append(req)
            if decision.result is not AddResult.CONTINUE:
                rejected.extend(opened[i + 1 :])
                return False
        if reply.not_owner is not None:  # as alloc_row would have raised on it
            if adder.could_admit(batch[len(reply.matches)]):
                raise NotOwnerError(f"request {reply.not_owner!r} belongs to another session")
            return False
        return not reply.out_of_rows

    def _tiers(self, match: AdmitMatch) -> dict[str, int | str]:
        """Where a match's prefix came from, per tier, in SGLang's keys (the host and
        disk parts are loaded into fresh device pages by memsvc, fenced before the
        extend's ``alloc_extend``)."""
        tiers: dict[str, int | str] = {"device": match.device_hit, "host": match.host_hit}
        backend = self.mem.hello_info["hicache"].get("storage_backend")
        if match.storage_hit or backend:  # SGLang's keys: storage ones with a storage tier
            tiers["storage"] = match.storage_hit
        if backend:
            tiers["storage_backend"] = backend
        return tiers

    async def _allocate(self, chunk_len: int, started: list[Req], rejected: list[str]) -> list[Req]:
        """Allocate this round's extends in one call, closing ``rejected`` in it;
        returns the batch to run.

        The budget makes this fit unless the pool moved since it was read
        (another session took pages) or the in-progress chunk (admitted
        whatever the budget) does not fit: then admissions are undone from
        the last one until the rest fits; the chunk, first, goes last and is
        tried again next round. An admission whose prefix load failed in
        memsvc (``cut``) is undone whatever the room (:meth:`_requeue_cut`).
        Each undone admission is closed by the next call. A chunk the SWA
        budget parked (``chunk_len`` 0) stays the chunked request, unallocated.
        """
        chunked = self.chunked if chunk_len > 0 else None
        started = list(started)
        free = list(rejected)
        while started or chunked is not None:
            items = [(r.rid, r.extend_len) for r in started]
            if chunked is not None:
                items.insert(0, (chunked.rid, chunk_len))
            result = await self.mem.alloc_extend(items, free)
            free = []
            if result.fits:
                break
            if result.cut:
                started, free = self._requeue_cut(started, result.cut)
                continue
            if not started:
                return []
            req = started.pop()
            free.append(req.rid)
            req.unschedule()
            self.waiting.appendleft(req)
        await self._free_rows(free)
        for req in started:
            if req.retracted_stain:
                self.cost.observe_readmit(len(req.origin_input_ids), req.prefix_len)
            self._mark_readmitted(req)
        if chunked is None:
            return started  # a parked chunk (if any) stays self.chunked
        chunked.continue_prefill(chunk_len)
        self.chunked = None  # until the adder says it is (still) chunked
        return [chunked, *started]

    async def _free_rows(self, rids: list[str]) -> None:
        """Close ``rids`` as ``free_row`` does, in one round trip."""
        if rids:
            await self.mem.release_many([(rid, None, False) for rid in rids])

    def _requeue_cut(self, started: list[Req], cut: dict[str, int]) -> tuple[list[Req], list[str]]:
        """Undo the admissions whose matched prefix memsvc cut back (a page loaded for
        it was lost or failed its checksum): they go back to the front of the queue,
        to match again (the good prefix, on the device now) and recompute the rest.
        A miss for them alone: the rest of the batch goes on. Returns the rest, and
        the rids to close."""
        again = [r for r in started if r.rid in cut]
        for req in again:
            req.unschedule()
        self.waiting.extendleft(reversed(again))
        self.stats.cut_prefix_reqs += len(again)
        log.warning(
            "cached prefix of %s failed to load (a storage page lost or damaged): recomputing it",
            [(r.rid, cut[r.rid]) for r in again],
        )
        return [r for r in started if r.rid not in cut], [r.rid for r in again]

    async def _resume_from_host(self, req: Req, adder: PrefillAdder) -> bool:
        """Re-admit a request whose KV is in the host store: load it back, no prefill."""
        if not adder.add_resumed_req(req):
            return False
        try:
            row = await self.open_row(req)
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
        self.stats.prefill_passes += 1
        self.stats.prefill_pass_reqs += len(batch)
        prefilled: list[tuple[Req, int]] = []
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
            prefilled.append((req, int(token)))
        await self._prefilled(prefilled)

    async def _prefilled(self, prefilled: list[tuple[Req, int]]) -> None:
        """Each request's final prefill round sampled its token: start decoding (or
        finish). One round trip publishes them all, one releases those finished."""
        decoding, finished = [], []
        for req, token in prefilled:
            req.append_token(token)
            self.stats.generated_tokens += 1
            if req.check_finished(self.eos_token_ids):
                finished.append(req)
                continue
            req.start_decode()
            decoding.append(req)
        if decoding:
            # Publish the prompts to the prefix tree (SGLang's cache_unfinished_req):
            # a retracted request later finds its own there and recomputes only its tail.
            await self.mem.cache_unfinished_many(
                [(r.rid, r.fill_ids[: r.kv_len]) for r in decoding]
            )
        for req in decoding:
            self.running.append(req)
            self.emit(req, False)
        await self._finish_many(finished)


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
