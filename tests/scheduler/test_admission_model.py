"""PrefillAdder against a small reference model of SGLang 0.5.23's admission budget.

The model is written from ``reference/sglang-retract-semantics.md`` §5.2-5.5
and the 0.5.23 notes D25 (one extra page per admitted request), D29 (one
check, under the prefix lock), D30 (first chunks end on a page boundary) and
D32 (the in-progress chunk: ``min(rem_chunk, int(remaining_total))``, else
the chunk budget; no page floor), plus the differences kvstack keeps on
purpose (docs/sglang-differences.md): the check rounds the extend up to
pages, and by default a re-admitted request reserves only the output it has
left. The machine drives the adder the way the engine does: each candidate's
prefix match may pin evictable tokens (they leave the budget, as SGLang's live
read of available + evictable sees), and the round ends at the first result
other than CONTINUE.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler_svc.core import AddResult, PrefillAdder, Req
from tests.scheduler.helpers import config, make_req, running_req

CONTINUE, NO_TOKEN, OTHER = AddResult.CONTINUE, AddResult.NO_TOKEN, AddResult.OTHER
CLIP = 4096


def ceil_to(n: int, page: int) -> int:
    return -(-n // page) * page


def floor_to(n: int, page: int) -> int:
    return n // page * page


class BudgetModel:
    """available + evictable, minus what running requests and this round reserved."""

    def __init__(
        self,
        page: int,
        chunk: int | None,
        max_prefill: int,
        free_slots: int,
        readmit_full: bool,
        available: int,
        running_reserved: float,
    ) -> None:
        self.page, self.readmit_full = page, readmit_full
        self.available = available
        self.running_reserved = running_reserved
        self.total_offset = self.current_offset = 0
        self.rem_input, self.rem_chunk = max_prefill, chunk
        self.free_slots = free_slots
        self.num_admitted = 0

    @property
    def remaining_total(self) -> float:
        return self.available - self.running_reserved - self.total_offset

    @property
    def remaining_current(self) -> int:
        return self.available - self.current_offset

    def state(self) -> AddResult:
        if self.remaining_total <= 0 or self.remaining_current <= 0:
            return NO_TOKEN
        if self.rem_input <= 0 or (self.rem_chunk is not None and self.rem_chunk <= 0):
            return OTHER
        return CONTINUE

    @staticmethod
    def left(max_new: int, generated: int) -> int:
        return min(max(max_new - generated, 0), CLIP)

    def reserved(self, max_new: int, generated: int) -> int:
        return min(max_new, CLIP) if self.readmit_full else self.left(max_new, generated)

    def reserve(self, extend: int, output: int, *, counts_as_input: bool = True) -> None:
        paged = ceil_to(extend, self.page)
        self.total_offset += paged + self.page + output
        self.current_offset += paged + self.page
        if counts_as_input:
            self.rem_input -= paged
            if self.rem_chunk is not None:
                self.rem_chunk -= paged
        self.free_slots -= 1
        self.num_admitted += 1

    def add_one(self, seq_len: int, prefix: int, generated: int, max_new: int):
        if self.free_slots <= 0:
            return OTHER, 0
        if self.state() is not CONTINUE:
            return self.state(), 0
        extend = seq_len - prefix
        paged = ceil_to(extend, self.page)
        if paged + self.page + self.left(max_new, generated) >= self.remaining_total:
            return NO_TOKEN, 0
        if self.rem_chunk is None:
            if self.num_admitted and paged >= self.rem_input:
                return OTHER, 0
        elif paged > self.rem_chunk:
            chunk = floor_to(prefix + floor_to(self.rem_chunk, self.page), self.page) - prefix
            if chunk <= 0:
                return OTHER, 0
            self.reserve(chunk, 0)
            return self.state(), chunk
        self.reserve(extend, self.reserved(max_new, generated))
        return self.state(), extend

    def add_chunked(self, seq_len: int, done: int, max_new: int):
        limit = min(self.rem_chunk, int(self.remaining_total))
        if limit <= 0:
            limit = self.rem_chunk
        extend = min(seq_len - done, limit)
        last = extend == seq_len - done
        self.reserve(extend, self.reserved(max_new, 0) if last else 0)
        return self.state(), extend

    def add_resumed(self, seq_len: int, generated: int, max_new: int) -> bool:
        """kvstack's host-store resume: all but the last token's KV at once, no compute."""
        if self.free_slots <= 0 or self.state() is not CONTINUE:
            return False
        kv_len = seq_len - 1
        if ceil_to(kv_len, self.page) + self.page + self.left(max_new, generated) >= (
            self.remaining_total
        ):
            return False
        self.reserve(kv_len, self.reserved(max_new, generated), counts_as_input=False)
        return True


ROUNDS = st.fixed_dictionaries(
    {
        "page": st.sampled_from([1, 4, 16]),
        "chunk_pages": st.one_of(st.none(), st.integers(1, 8)),
        "max_prefill": st.integers(1, 600),
        "max_running": st.integers(1, 12),
        "readmit_full": st.booleans(),
        "available": st.integers(0, 1500),
        "evictable": st.integers(0, 1500),
        "ratio": st.floats(0, 1),
        "running": st.lists(st.tuples(st.integers(1, 600), st.integers(1, 600)), max_size=3),
        "chunked": st.one_of(st.none(), st.tuples(st.integers(2, 300), st.floats(0, 0.99))),
    }
)


def in_progress_chunk(input_len: int, done_fraction: float) -> Req | None:
    req = make_req("chunked", input_len=input_len, max_new_tokens=50)
    done = max(int(input_len * done_fraction), 1)
    if done >= input_len:
        return None
    req.start_prefill(row=1, prefix_len=0, extend_len=done)
    req.complete_extend()
    return req


class AdmissionMachine(RuleBasedStateMachine):
    """One admission round after another, each with a fresh adder and model."""

    @initialize(spec=ROUNDS)
    def first_round(self, spec) -> None:
        self.num_reqs = 0
        self._start_round(spec)

    def _next_round_if_over(self, data: st.DataObject) -> None:
        """The engine stops a round at the first result other than CONTINUE."""
        if self.round_over:
            self._start_round(data.draw(ROUNDS, label="next round"))

    def _start_round(self, spec) -> None:
        page = spec["page"]
        chunk = None if spec["chunk_pages"] is None else spec["chunk_pages"] * page
        cfg = config(
            page_size=page,
            chunked_prefill_size=chunk,
            max_prefill_tokens=spec["max_prefill"],
            max_running_requests=spec["max_running"],
            readmit_charge="full" if spec["readmit_full"] else "remaining",
        )
        running = [
            running_req(f"run{i}", 4, min(out, max_new), max_new)
            for i, (max_new, out) in enumerate(spec["running"])
        ]
        chunked = None
        if spec["chunked"] is not None and chunk is not None:
            chunked = in_progress_chunk(*spec["chunked"])
        self.available, self.evictable = spec["available"], spec["evictable"]
        ratio = spec["ratio"]
        self.adder = PrefillAdder(
            cfg, self.available + self.evictable, running, ratio, chunked_req=chunked
        )
        reserved = sum(
            BudgetModel.left(r.sampling_params.max_new_tokens, len(r.output_ids)) * ratio
            for r in running
        )
        self.model = BudgetModel(
            page,
            chunk,
            spec["max_prefill"],
            spec["max_running"] - len(running),
            spec["readmit_full"],
            self.available + self.evictable,
            reserved,
        )
        self.round_over = False
        if chunked is not None:
            d = self.adder.add_chunked_req(chunked)
            left = chunked.seq_len - chunked.kv_len
            assert (d.result, d.extend_len) == self.model.add_chunked(
                chunked.seq_len, chunked.kv_len, 50
            )
            assert (self.adder.new_chunked_req is chunked) == (d.extend_len < left)

    def _new_req(self, input_len: int, generated: int, max_new: int) -> Req:
        self.num_reqs += 1
        return make_req(f"q{self.num_reqs}", input_len, generated, max_new)

    @rule(
        data=st.data(),
        input_len=st.integers(1, 400),
        generated=st.integers(0, 200),
        max_new=st.one_of(st.integers(0, 400), st.integers(4000, 5000)),
        hit=st.floats(0, 1),
        pinned=st.floats(0, 1),
    )
    def add_one_req(self, data, input_len, generated, max_new, hit, pinned) -> None:
        self._next_round_if_over(data)
        req = self._new_req(input_len, min(generated, max_new), max_new)
        page = self.model.page
        prefix = floor_to(min(int(req.seq_len * hit), req.seq_len - 1), page)
        # The match locks the prefix: whatever part of it was evictable is pinned now.
        num_pinned = min(floor_to(int(prefix * pinned), page), self.evictable)
        self.evictable -= num_pinned
        self.adder.lock_prefix(num_pinned)
        self.model.available -= num_pinned
        d = self.adder.add_one_req(req, prefix)
        expected = self.model.add_one(req.seq_len, prefix, len(req.output_ids), max_new)
        assert (d.result, d.extend_len) == expected
        if not d.admitted:
            self.evictable += num_pinned  # the engine frees its row: the lock goes
        if d.result is not CONTINUE:
            self.round_over = True

    @rule(
        data=st.data(),
        input_len=st.integers(1, 400),
        generated=st.integers(1, 200),
        max_new=st.integers(1, 400),
    )
    def add_resumed_req(self, data, input_len, generated, max_new) -> None:
        self._next_round_if_over(data)
        req = self._new_req(input_len, min(generated, max_new), max_new)
        admitted = self.adder.add_resumed_req(req)
        assert admitted == self.model.add_resumed(req.seq_len, len(req.output_ids), max_new)
        if not admitted:
            self.round_over = True

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "adder"):
            return
        adder, model = self.adder, self.model
        assert adder.remaining_total_tokens == pytest.approx(model.remaining_total, abs=1e-6)
        assert adder.remaining_current_tokens == model.remaining_current
        assert (adder.rem_input_tokens, adder.rem_chunk_tokens) == (
            model.rem_input,
            model.rem_chunk,
        )
        assert len(adder.admitted) == model.num_admitted
        assert adder.budget_state() is model.state()


TestAdmissionModel = AdmissionMachine.TestCase
TestAdmissionModel.settings = settings(
    max_examples=100, stateful_step_count=12, deadline=None, derandomize=True
)
