"""PrefillAdder: the token budget of one admission round.

Build a fresh adder each scheduling round. Budgets, in tokens::

    A = available + evictable       (memsvc's at the start of the round, less what
                                     each candidate's prefix lock pins)
    remaining_total   = A − Σ running reservations − Σ admitted charges
                        "can everything running and admitted still finish?"
    remaining_current = A − Σ admitted prefill charges
                        "does this round's prefill itself fit right now?"

    running reservation = min(max_new − generated, clip) × ratio   (ratio 1.0 under ignore_eos)
    admitted charge     = ceil_page(extend) + page_size + reserved output  (to total)
                        = ceil_page(extend) + page_size                    (to current)
    reserved output     = min(max_new − generated, clip)    (readmit_charge="remaining")
                        = min(max_new, clip)                (readmit_charge="full", SGLang)

A follows the locks as in SGLang, which reads it live: matching a
candidate's prefix locks it, and the tokens the lock pins are no longer
evictable, so the engine reports them to :meth:`PrefillAdder.lock_prefix`
before :meth:`~PrefillAdder.add_one_req`. Nothing else changes A during a
round: allocation happens after the loop, and a load from the host store
during it is charged like an admission, not taken from A.

The extra page per admitted request covers paged-allocation rounding
(SGLang 0.5.23) and is what makes the intake clamp of ``policy.py`` agree
with admission: a request clamped there always fits an empty pool. A chunk
that is not the last reserves no output. ``generated`` is 0 except for a
retracted request being re-admitted.

A request is admitted only if ``ceil_page(extend) + page_size + min(max_new −
generated, clip)`` is strictly below ``remaining_total``; by default that is
also its charge, so admissions never overdraw the budget. (SGLang checks with
the unrounded ``extend``, which can overdraw by up to a page: a difference
kept on purpose, see docs/sglang-differences.md.) Only the in-progress chunk
is always admitted, since it already holds KV.

Hybrid (sliding-window) models add SGLang 0.5.23's separate SWA gate
(:class:`~scheduler_svc.core.swa_budget.SwaPrefillGate`, D26): the budget
state is NO_TOKEN also when ``remaining_swa`` is gone; a request must pass the
SWA check too, which may lower its chunk limit (D30); and the in-progress
chunk is parked for the round (not admitted, nothing charged) when the SWA
budget leaves it nothing (D32) and requests are running (whose decoding frees
SWA pages; with none, parking would wait forever: docs/sglang-differences.md).
A pure-SWA model bases ``A`` on the SWA pool.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Req
from scheduler_svc.core.swa_budget import SwaPrefillGate


def ceil_page(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size) * page_size


def floor_page(num_tokens: int, page_size: int) -> int:
    return num_tokens // page_size * page_size


def running_reservation(req: Req, new_token_ratio: float, clip: int) -> float:
    """What a running request is expected still to need: its remaining output, scaled."""
    remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    ratio = 1.0 if req.sampling_params.ignore_eos else new_token_ratio
    return min(remaining, clip) * ratio


class AddResult(Enum):
    CONTINUE = "continue"  # keep adding
    NO_TOKEN = "no_token"  # out of KV tokens: the batch is full until memory frees up
    OTHER = "other"  # another limit (request count, prefill/chunk tokens): stop for this round


class AddDecision(NamedTuple):
    """``extend_len > 0``: admitted, compute that many tokens this round (maybe a chunk).

    ``result`` says whether to try the next request. A request can be admitted
    and still end the round (e.g. its chunk used up the chunk budget).
    ``extend_len == 0``: not admitted, nothing charged; ``result`` says why.
    """

    result: AddResult
    extend_len: int

    @property
    def admitted(self) -> bool:
        return self.extend_len > 0


class Admission(NamedTuple):
    req: Req
    prefix_len: int
    extend_len: int


class PrefillAdder:
    """Admission decisions for one round; every call either admits and charges, or changes nothing.

    Call :meth:`add_chunked_req` first when a chunked prefill is in progress
    (name it as ``chunked_req``), then :meth:`add_one_req` for waiting requests
    in queue order, stopping at the first result other than CONTINUE.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        available_tokens: int,
        running_reqs: Sequence[Req] = (),
        new_token_ratio: float | None = None,
        num_running_reqs: int | None = None,
        chunked_req: Req | None = None,
        swa: SwaPrefillGate | None = None,
    ) -> None:
        if available_tokens < 0:
            raise ValueError(f"available_tokens must be >= 0, got {available_tokens}")
        if new_token_ratio is None:
            if running_reqs:
                raise ValueError("running requests need the tracker's new_token_ratio")
            new_token_ratio = 0.0
        self.config = config
        self.page_size = config.page_size
        self.swa = swa
        if swa is not None and swa.spec.all_swa:  # every layer windowed: the SWA pool is A
            available_tokens = max(swa.base_tokens, 0)
        self.available_tokens = available_tokens
        self.new_token_ratio = new_token_ratio
        self.num_running_reqs = len(running_reqs) if num_running_reqs is None else num_running_reqs
        self.chunked_req = chunked_req
        clip = config.clip_max_new_tokens
        self.running_reserved: float = sum(
            running_reservation(r, new_token_ratio, clip) for r in running_reqs
        )
        self.admitted_offset: int = 0  # charges of this round's admissions (to the total)
        self.current_offset: int = 0
        self.rem_input_tokens: int = config.max_prefill_tokens
        self.rem_chunk_tokens: int | None = config.chunked_prefill_size
        self.admitted: list[Admission] = []
        self.new_chunked_req: Req | None = None
        self._chunked_added = False
        self._chunk_parked = False  # the SWA budget parked the in-progress chunk this round
        # For logs/metrics: prefix hits and computed tokens, first attempts vs re-prefills.
        self.num_hit_tokens = self.num_input_tokens = 0
        self.num_reprocessed_hit_tokens = self.num_reprocessed_input_tokens = 0

    # -- state -----------------------------------------------------------------

    @property
    def total_offset(self) -> float:
        return self.running_reserved + self.admitted_offset

    @property
    def remaining_total_tokens(self) -> float:
        return self.available_tokens - self.admitted_offset - self.running_reserved

    @property
    def remaining_current_tokens(self) -> int:
        return self.available_tokens - self.current_offset

    @property
    def num_free_request_slots(self) -> int:
        """``max_running_requests`` minus running and admitted-this-round requests."""
        return self.config.max_running_requests - self.num_running_reqs - len(self.admitted)

    def budget_state(self) -> AddResult:
        if self.remaining_total_tokens <= 0 or self.remaining_current_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.swa is not None and not self.swa.has_capacity():
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (
            self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0
        ):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def lock_prefix(self, num_pinned_tokens: int, swa_pinned_tokens: int = 0) -> None:
        """A candidate's prefix match locked its prefix: what was evictable of it leaves A.

        ``num_pinned_tokens`` is how much memsvc's evictable size fell with
        the lock (0 when the prefix was already locked by running requests);
        ``swa_pinned_tokens`` the same for the SWA pool's evictable size (a
        hybrid pool: the locked prefix's SWA tail). SGLang reads available +
        evictable live, after that lock.
        """
        if not 0 <= num_pinned_tokens <= self.available_tokens:
            raise ValueError(
                f"cannot pin {num_pinned_tokens} of {self.available_tokens} available tokens"
            )
        self.available_tokens -= num_pinned_tokens
        if self.swa is not None and swa_pinned_tokens:
            self.swa.pin(swa_pinned_tokens)

    def charge(self, extend_len: int, max_new_tokens: int) -> int:
        """What admitting ``extend_len`` tokens reserving ``max_new_tokens`` adds to the total."""
        return ceil_page(extend_len, self.page_size) + self.page_size + max_new_tokens

    def scratch(self) -> PrefillAdder:
        """A copy to judge candidates on without changing this budget."""
        other = copy.copy(self)
        other.admitted = list(self.admitted)
        other.swa = copy.copy(self.swa)
        return other

    def could_admit(self, req: Req) -> bool:
        """Whether ``req`` could be admitted with the best prefix hit it could get.

        A cheap pre-check before asking memsvc to match its prefix: with the
        longest possible hit (all of ``fill_ids`` but the last page-aligned
        token) it would still need this much; if even that does not fit, a
        match cannot change the answer.
        """
        if self.num_free_request_slots <= 0 or self.budget_state() is not AddResult.CONTINUE:
            return False
        best_prefix = floor_page(req.seq_len - 1, self.page_size)
        charge = self.charge(req.seq_len - best_prefix, self.remaining_max_new(req))
        return charge < self.remaining_total_tokens

    def remaining_max_new(self, req: Req) -> int:
        """What ``req`` may still generate, clipped: what admission checks for its output."""
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
        return min(max(remaining, 0), self.config.clip_max_new_tokens)

    def reserved_max_new(self, req: Req) -> int:
        """What admitting ``req`` whole reserves for its output.

        The same as :meth:`remaining_max_new` by default. SGLang reserves the
        whole ``min(max_new_tokens, clip)`` even for a retracted request that
        has already generated part of it (``readmit_charge="full"``).
        """
        if self.config.readmit_charge == "full":
            return min(req.sampling_params.max_new_tokens, self.config.clip_max_new_tokens)
        return self.remaining_max_new(req)

    def _chunk_len(self, prefix_len: int, limit: int) -> int:
        # Whole pages, and the chunk must end on a page boundary of the sequence.
        chunk = floor_page(limit, self.page_size)
        return floor_page(prefix_len + chunk, self.page_size) - prefix_len

    def _reserve(self, req: Req, prefix_len: int, extend_len: int, max_new_tokens: int) -> None:
        paged = ceil_page(extend_len, self.page_size)
        self.admitted_offset += paged + self.page_size + max_new_tokens
        self.current_offset += paged + self.page_size
        self.rem_input_tokens -= paged
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= paged
        if self.swa is not None:
            self.swa.reserve(extend_len, max_new_tokens)
        self.admitted.append(Admission(req, prefix_len, extend_len))

    def _log_tokens(self, req: Req, hit_len: int, extend_len: int) -> None:
        if req.retracted_stain:
            self.num_reprocessed_hit_tokens += hit_len
            self.num_reprocessed_input_tokens += extend_len
        else:
            self.num_hit_tokens += hit_len
            self.num_input_tokens += extend_len

    # -- admission -------------------------------------------------------------

    def add_resumed_req(self, req: Req) -> bool:
        """A retracted request whose KV comes back from the host store: no compute.

        It needs slots for all but its last token at once, plus the usual
        reservation for what it may still generate; admitted (and charged) if
        that fits, else nothing changes.
        """
        kv_len = req.seq_len - 1
        if self.num_free_request_slots <= 0 or self.budget_state() is not AddResult.CONTINUE:
            return False
        if self.charge(kv_len, self.remaining_max_new(req)) >= self.remaining_total_tokens:
            return False
        if self.swa is not None:
            if not self.swa.check(kv_len, self.remaining_max_new(req), None)[0]:
                return False
            self.swa.reserve(kv_len, self.reserved_max_new(req))
        paged = ceil_page(kv_len, self.page_size)
        self.admitted_offset += paged + self.page_size + self.reserved_max_new(req)
        self.current_offset += paged + self.page_size
        self.admitted.append(Admission(req, kv_len, 0))
        return True

    def add_chunked_req(self, req: Req) -> AddDecision:
        """Admit the next chunk of the in-progress chunked prefill. Always admitted.

        Its KV so far is held by the request, so skipping it would strand it.
        As in SGLang, the chunk is the rest of the prompt cut to
        ``min(rem_chunk_tokens, int(remaining_total))``, or to the chunk budget
        alone when that minimum is not positive; it is not cut to whole pages,
        so it may end inside one. It reserves the request's output only when
        it is the last.
        """
        if req is not self.chunked_req or self._chunked_added or self.admitted:
            raise ValueError("add_chunked_req: pass the adder's chunked_req, once, before others")
        if self.rem_chunk_tokens is None:
            raise ValueError("add_chunked_req: chunked prefill is off")
        if req.extend_in_flight:
            raise ValueError(f"chunked request {req.rid!r}: previous chunk not completed")
        self._chunked_added = True
        prefix_len = req.kv_len
        full_len = req.seq_len - prefix_len
        if full_len < 1:
            raise ValueError(f"chunked request {req.rid!r} has nothing left to prefill")
        swa_limit = None
        if self.swa is not None:
            swa_limit = self.swa.available_chunk_tokens(
                self.rem_chunk_tokens, self.remaining_total_tokens
            )
        if swa_limit is None and self.swa is not None and self.num_running_reqs > 0:
            # Parked: not admitted this round, nothing charged; the running requests'
            # decoding frees SWA pages as their windows slide. (With none running nothing
            # would: the single-pool rule goes on, memsvc's allocation deciding.)
            self._chunk_parked = True
            return AddDecision(self.budget_state(), 0)
        if swa_limit is not None:
            limit = swa_limit
        elif self.swa is not None and self.swa.remaining_swa <= self.page_size:
            # Nothing running and the SWA budget leaves no page beside the rounding one:
            # one page. memsvc frees the window's out-of-window SWA pages before it
            # judges the allocation, and intake refused what this could not fit
            # (check_swa_fits), so it progresses where the whole chunk never would.
            limit = self.page_size
        else:
            limit = min(self.rem_chunk_tokens, int(self.remaining_total_tokens))
            if limit <= 0:  # the total budget is gone: the chunk budget alone decides
                limit = self.rem_chunk_tokens
            if self.swa is not None:  # nor more than the SWA budget takes
                limit = min(limit, self.swa.remaining_swa - self.page_size)
        extend_len = min(full_len, limit)
        is_last = extend_len == full_len
        self._reserve(req, prefix_len, extend_len, self.reserved_max_new(req) if is_last else 0)
        self._log_tokens(req, 0, extend_len)  # its hit was logged with the first chunk
        if not is_last:
            self.new_chunked_req = req
        return AddDecision(self.budget_state(), extend_len)

    def add_one_req(self, req: Req, prefix_len: int) -> AddDecision:
        """Try to admit a waiting request whose first ``prefix_len`` tokens hit the cache.

        Call :meth:`lock_prefix` first if matching the prefix pinned tokens.
        In order: OTHER if ``max_running_requests`` is reached; the budget
        state if it is no longer CONTINUE; NO_TOKEN if the whole request's
        check (see the module docstring) is not strictly below
        ``remaining_total``; OTHER if (chunking off) the prompt would reach
        the prefill-token cap and is not the first admitted. Otherwise it is
        admitted whole or, with chunking, as a page-aligned chunk that fills
        the chunk budget.
        """
        if self.chunked_req is not None and not self._chunked_added:
            raise ValueError("add_one_req: add the chunked request first")
        extend_len = req.seq_len - prefix_len
        if not 0 <= prefix_len < req.seq_len:
            raise ValueError(
                f"prefix_len {prefix_len} outside [0, {req.seq_len}) for request {req.rid!r}"
            )
        if self.num_free_request_slots <= 0:
            return AddDecision(AddResult.OTHER, 0)
        state = self.budget_state()
        if state is not AddResult.CONTINUE:
            return AddDecision(state, 0)
        if self.charge(extend_len, self.remaining_max_new(req)) >= self.remaining_total_tokens:
            return AddDecision(AddResult.NO_TOKEN, 0)
        chunk_limit = self.rem_chunk_tokens
        if self.swa is not None:  # the SWA gate may lower the chunk limit (SGLang's D30)
            fits, chunk_limit = self.swa.check(extend_len, self.remaining_max_new(req), chunk_limit)
            if not fits:
                if self.num_running_reqs > 0 or self.admitted:
                    return AddDecision(AddResult.NO_TOKEN, 0)
                # Alone: nothing running will free an SWA page, so the shortfall is not
                # transient (e.g. its own cached prefix's SWA tail, pinned by its prefix
                # lock, counted again in its reservation) and waiting would be forever.
                # With chunking, one page; without, whole: memsvc's allocation decides
                # (it frees the window's out-of-window SWA pages first; intake refused
                # what the pool could never hold).
                chunk_limit = None if self.rem_chunk_tokens is None else self.page_size
        input_tokens = ceil_page(extend_len, self.page_size)
        if chunk_limit is None:
            if self.admitted and input_tokens >= self.rem_input_tokens:
                return AddDecision(AddResult.OTHER, 0)
        elif input_tokens > chunk_limit:
            if self._chunk_parked:  # one chunked request at a time: the parked one stays it
                return AddDecision(AddResult.OTHER, 0)
            chunk_len = self._chunk_len(prefix_len, chunk_limit)
            if chunk_len <= 0:
                return AddDecision(AddResult.OTHER, 0)
            self._reserve(req, prefix_len, chunk_len, 0)
            self._log_tokens(req, prefix_len, chunk_len)
            self.new_chunked_req = req
            return AddDecision(self.budget_state(), chunk_len)
        self._reserve(req, prefix_len, extend_len, self.reserved_max_new(req))
        self._log_tokens(req, prefix_len, extend_len)
        return AddDecision(self.budget_state(), extend_len)

    def __repr__(self) -> str:
        swa = "" if self.swa is None else f"remaining_swa={self.swa.remaining_swa}, "
        return (
            f"PrefillAdder(remaining_total={self.remaining_total_tokens:.1f}, {swa}"
            f"remaining_current={self.remaining_current_tokens}, "
            f"rem_input={self.rem_input_tokens}, rem_chunk={self.rem_chunk_tokens}, "
            f"admitted={len(self.admitted)})"
        )
