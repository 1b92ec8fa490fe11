"""The PD decode node's budget on the SWA pool of a hybrid model.

SGLang's ``_swa_aware_allocatable_token_budgets`` and the SWA gates of
``pop_preallocated`` and ``resume_retracted_reqs`` (reference §7.2;
differences D41-D43), on the pure formulas of
:mod:`scheduler_svc.core.swa_budget`. They apply only under SGLang's
``_uses_swa_tail_prealloc``: a hybrid pool (memsvc's replies carry the SWA
pool's sizes) with ``page_size > 1``. Otherwise every gate here passes and
the decode node budgets the full pool alone, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler_svc.core import Req
from scheduler_svc.core.swa_budget import (
    SwaSizes,
    SwaSpec,
    need_swa_single,
    prealloc_required_tokens,
    swa_allocatable_tokens,
    swa_retractable_len,
)

if TYPE_CHECKING:
    from scheduler_svc.pd.decode import DecodeEngine


class DecodeSwaBudget:
    """The SWA half of the decode node's budget, read from ``engine``'s live sizes."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    def tail(self) -> tuple[SwaSpec, SwaSizes] | None:
        """The SWA pool's spec and live sizes when the SWA budget applies, else None."""
        engine = self.engine
        swa = engine.swa_budget_inputs(engine.mem.sizes)
        return swa if swa is not None and swa[0].uses_tail_prealloc else None

    def required(self, req: Req, spec: SwaSpec) -> int:
        """The SWA half of SGLang's ``_prealloc_required_tokens`` (D41)."""
        config = self.engine.config
        fill_len = self.engine._fill_len(req)
        return prealloc_required_tokens(
            fill_len, config.page_size, config.num_reserved_decode_tokens, spec
        )[1]

    @staticmethod
    def retractable_len(req: Req, spec: SwaSpec) -> int:
        """SGLang's ``_swa_retractable_len``."""
        return swa_retractable_len(len(req.origin_input_ids), len(req.output_ids), spec)

    def allocatable(
        self,
        spec: SwaSpec,
        sizes: SwaSizes,
        *,
        count_retracted: bool,
        retractable: list[Req] | None = None,
    ) -> int:
        """SGLang's SWA-tail budget (D42): the reserve of every active request, capped
        by the SWA growth left before each reaches its window, or the largest single
        need over ``retractable`` (the running requests that may be retracted; None:
        no single need), whichever is more; less the retracted queue's SWA
        requirements when ``count_retracted``."""
        engine = self.engine
        config = engine.config
        need = 0
        if retractable is not None:
            freeable = sum(self.retractable_len(r, spec) for r in retractable)
            lens = [
                (len(r.origin_input_ids), r.sampling_params.max_new_tokens) for r in retractable
            ]
            need = need_swa_single(lens, freeable, spec, config.clip_max_new_tokens)
        retracted = sum(self.required(r, spec) for r in engine.retracted) if count_retracted else 0
        return swa_allocatable_tokens(
            spec,
            sizes,
            n_active=len(engine.running) + len(engine.transfer),
            reserved_per_req=config.num_reserved_decode_tokens,
            need_single=need,
            retracted_swa_required=retracted,
        )

    def alone_fits(self, req: Req, spec: SwaSpec, allocatable: int) -> bool:
        """The decode node's starvation guard (``_alone_fits``) on the SWA pool: with
        nothing else active, what its SWA tail physically needs, without the reserve."""
        engine = self.engine
        busy = engine.running or engine.transfer
        reserve = engine.config.num_reserved_decode_tokens if spec.radix_cache else 0
        return not busy and self.required(req, spec) - reserve <= allocatable

    def resume_fits(self, req: Req) -> bool:
        """The SWA gate of a resume (D43): ``swa_required <= swa_allocatable``, the
        budget recomputed from the live pool with the requests resumed so far among
        the active ones (they are running by then). True when not hybrid."""
        swa = self.tail()
        if swa is None:
            return True
        spec, sizes = swa
        allocatable = self.allocatable(spec, sizes, count_retracted=False)
        return self.required(req, spec) <= allocatable or self.alone_fits(req, spec, allocatable)

    def prealloc_gate(self, retractable: list[Req]) -> SwaPreallocGate | None:
        """``pop_preallocated``'s SWA gate over this step's queue; None when not hybrid."""
        swa = self.tail()
        if swa is None:
            return None
        spec, sizes = swa
        return SwaPreallocGate(
            self,
            spec,
            self.allocatable(spec, sizes, count_retracted=True, retractable=retractable),
            sum(self.retractable_len(r, spec) for r in retractable),
        )


class SwaPreallocGate:
    """SGLang's SWA gate of ``pop_preallocated``, for one step's queue.

    ``max(swa_required, swa_len + min(max_new, clip) − retractable_swa_tokens)``
    must not exceed the SWA budget, read once at the start of the step and
    decreased by each preallocation's ``swa_required`` (SGLang's plain
    decrement: the SWA pool sees no radix lock change during the step).
    """

    def __init__(
        self, budget: DecodeSwaBudget, spec: SwaSpec, allocatable: int, retractable: int
    ) -> None:
        self.budget = budget
        self.spec = spec
        self.allocatable = allocatable
        self.retractable_swa_tokens = retractable

    def fits(self, req: Req) -> bool:
        budget, spec = self.budget, self.spec
        engine = budget.engine
        new = min(req.sampling_params.max_new_tokens, engine.config.clip_max_new_tokens)
        swa_len = spec.tail_len(engine._fill_len(req))
        gate = max(budget.required(req, spec), swa_len + new - self.retractable_swa_tokens)
        return gate <= self.allocatable or budget.alone_fits(req, spec, self.allocatable)

    def take(self, req: Req) -> None:
        self.allocatable -= self.budget.required(req, self.spec)
