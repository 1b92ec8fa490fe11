"""The engine's state, and every change to it that is not part of a round.

:class:`EngineBase` holds the queues (``waiting``, ``running``, the chunked
request, ``reqs``), the memsvc and model_svc clients, the new-token ratio and
the retract cost model. Its methods are what the two rounds
(:mod:`~scheduler_svc.engine.prefill_round`,
:mod:`~scheduler_svc.engine.decode_round`) and the engine's callers share:
client commands, applied between steps; the two endings of a request (finish,
abort); the sampling spec sent with each forward; and the repairs that
:mod:`scheduler_svc.recovery` and the service ask for between steps after a
fault, so that nothing outside the engine edits its queues.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memsvc.client import AsyncMemClient
from model_svc.client import AsyncModelClient
from scheduler_svc.core import NewTokenRatioTracker, Req, ReqState, SchedulerConfig
from scheduler_svc.core.retract_cost import RetractCostModel
from scheduler_svc.core.swa_budget import SwaSizes, SwaSpec, swa_sizes_of, swa_spec_of
from scheduler_svc.engine.stats import EngineStats

if TYPE_CHECKING:
    from scheduler_svc.adopt import Journal

Emit = Callable[[Req, bool], None]  # (request, finished): new tokens or the final result
HOLDS_KV = (ReqState.PREFILLING, ReqState.RUNNING)  # the states in which a request has KV


class EngineBase:
    """The state both rounds work on, and the changes to it outside a round."""

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
        # What a restarted scheduler needs, committed to memsvc (scheduler_svc.adopt);
        # None: nothing is committed (a prefill node, tests).
        self.journal: Journal | None = None
        self._commands: deque[tuple[str, Any]] = deque()
        layout = mem.layout
        self.cost = RetractCostModel(
            bytes_per_token=layout.bytes_per_token if layout else 0,
            page_size=config.page_size,
        )

    # -- commands (applied between steps) --------------------------------------

    def submit(self, req: Req) -> None:
        self._commands.append(("submit", req))

    def abort(
        self, rid: str, message: str = "Aborted by the client.", status_code: int = 499
    ) -> bool:
        """Queue an abort; True if ``rid`` is a live request."""
        if rid not in self.reqs and not any(
            kind == "submit" and item.rid == rid for kind, item in self._commands
        ):
            return False
        self._commands.append(("abort", (rid, message, status_code)))
        return True

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked or self._commands)

    def idle_wait_s(self, default: float) -> float:
        """How long the loop may sleep when a step did nothing (PD: transfers to poll)."""
        return default

    def settling(self) -> bool:
        """Not idle, but only with work that ends by itself within a step or two
        (queued commands): a full ``flush_cache`` waits for it a moment, not refused."""
        return bool(self._commands) and not (self.waiting or self.running or self.chunked)

    async def _apply_commands(self) -> None:
        while self._commands:
            kind, item = self._commands.popleft()
            if kind == "submit":
                self.reqs[item.rid] = item
                self._enqueue(item)
            elif item[0] in self.reqs:
                await self._abort(self.reqs[item[0]], *item[1:])

    async def commit_journal(self) -> None:
        """Commit what changed for a successor (scheduler_svc.adopt); no round trip if
        nothing did."""
        if self.journal is not None:
            await self.journal.commit(self)

    def _enqueue(self, req: Req) -> None:
        """A submitted request joins the queue it starts in: ``waiting`` here."""
        self.waiting.append(req)

    # -- adoption (scheduler_svc.adopt) ----------------------------------------

    # A request adopted without KV is computed again here; a PD decode node cannot.
    recomputes_adopted = True

    def adoptable(self) -> Callable[[Req], bool]:
        """Which requests a successor could continue exactly (the journal records them):
        not a PD hand-off."""
        return lambda req: req.bootstrap_room is None

    def adopt_from_host(self, reqs: list[Req]) -> None:
        """Adopted requests whose KV is in memsvc's host store: loaded back first."""
        self.waiting.extendleft(reversed(reqs))

    # -- shared by the rounds --------------------------------------------------

    @property
    def swa(self) -> SwaSpec | None:
        """The SWA pool of a hybrid (sliding-window) model, from memsvc's layout; None
        when the pool is not hybrid (then every budget is the single pool's, as before)."""
        spec = swa_spec_of(self.mem.layout)
        if spec is not None and (getattr(self.mem, "hello_info", None) or {}).get(
            "disable_radix_cache"
        ):
            spec = SwaSpec(spec.sliding_window, spec.capacity, spec.page_size, spec.all_swa, False)
        return spec

    def swa_budget_inputs(self, sizes: object) -> tuple[SwaSpec, SwaSizes] | None:
        """The SWA pool's spec and its live sizes in ``sizes`` (a memsvc reply's), or None
        unless both are there: a hybrid pool whose replies carry SWA numbers."""
        spec = self.swa
        swa_sizes = swa_sizes_of(sizes) if spec is not None else None
        return None if swa_sizes is None else (spec, swa_sizes)  # type: ignore[return-value]

    @property
    def hierarchical(self) -> bool:
        """memsvc runs the hierarchical cache (host and maybe disk tiers under the tree)."""
        return bool((getattr(self.mem, "hello_info", None) or {}).get("hicache"))

    async def open_row(self, req: Req) -> int:
        """Open ``req`` in memsvc, in its cache namespace; returns its req_to_token row."""
        return await self.mem.alloc_row(req.rid, namespace=req.namespace)

    def _mark_readmitted(self, req: Req) -> None:
        """A retracted request is back: the thrash guard's cooldown starts now."""
        if req.retracted_stain:
            req.readmit_step = self.stats.forward_passes

    def _sampling(self, req: Req) -> dict[str, Any]:
        """The worker's ``SamplingSpec`` for ``req``'s next token: its record's ``draw``
        as it came (a seed of 0 or none: one from the rid), and what this step decides."""
        draw = req.sampling_params.draw
        spec = {**draw, "seed": draw.get("seed") or seed_from_rid(req.rid)}
        if req.return_logprob:
            spec["logprobs"] = True
            spec["top_logprobs_num"] = req.top_logprobs_num
        suppress = req.suppressed_token_ids(self.eos_token_ids)
        if suppress:
            spec["suppress_token_ids"] = suppress
        return spec

    # -- endings ---------------------------------------------------------------

    async def _finish_many(self, reqs: list[Req]) -> None:
        """Cache the finished requests' KV in the tree, their releases in one round
        trip, and report each result."""
        if not reqs:
            return
        await self.mem.release_many([(r.rid, r.fill_ids[: r.kv_len], True) for r in reqs])
        for req in reqs:
            self._finished(req)

    def _finished(self, req: Req) -> None:
        """A finished request's KV went back to memsvc: report the result."""
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

    # -- repairs between steps (scheduler_svc.recovery, the service) -----------

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


def output_logprob(result: Any, index: int) -> tuple[float | None, Any]:
    """The sampled token's logprob and top-k (``[[logprob, id], ...]``) in ``result``."""
    logprobs = getattr(result, "logprobs", None)
    tops = getattr(result, "top_logprobs", None)
    top = tops[index] if tops is not None else None
    if top is not None:
        top = [[value, token] for value, token in zip(top[0], top[1], strict=True)]
    return (logprobs[index] if logprobs is not None else None), top


def seed_from_rid(rid: str) -> int:
    """A stable per-request seed for requests that chose none (so equal prompts can differ)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") >> 1
