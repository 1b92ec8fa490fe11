"""One simulation: a workload through the real Engine, memsvc in process, a simulated worker.

The loop is the serving loop with time replaced::

    submit every request whose arrival <= clock.now
    Engine.step()            (the worker and SimMem advance the clock)
    record a time-series sample
    nothing to do?  idle: jump the clock to the next arrival
                    stuck (nothing running, head never admissible): abort the head

Requests go through the scheduler service's intake first (``check_fits``,
``clamp_max_new_tokens``), so the engine sees what a real one would. Every
figure is in simulated seconds and depends only on the workload, the spec
and the engine: the same seed gives the same figures.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstack.sim.costmodel import SimClock
from kvstack.sim.inproc import RetractEvent, SimMem, build_service, tiny_layout
from kvstack.sim.settings import SimSpec
from kvstack.sim.timing import clock_engine_costs
from kvstack.sim.worker import EOS, SimWorker, expected_output
from kvstack.sim.workload import RequestSpec, prompt_tokens
from memsvc.handlers import MemService
from scheduler_svc.core import (
    Req,
    RequestTooLargeError,
    SamplingParams,
    SchedulerConfig,
    check_fits,
    clamp_max_new_tokens,
)
from scheduler_svc.core.swa_budget import full_available_of
from scheduler_svc.core.swa_intake import check_swa_fits
from scheduler_svc.engine import Engine


@dataclass(slots=True)
class RequestResult:
    rid: str
    arrival: float
    input_len: int
    max_new_tokens: int  # after the intake clamp (0: rejected)
    status: str = "waiting"  # finished | aborted | rejected
    output_len: int = 0
    retractions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival

    def note_reply(self, req: Req, finished: bool, now: float) -> bool:
        """The engine replied for this request at ``now``; returns whether it finished."""
        if self.first_token_s is None and req.output_ids:
            self.first_token_s = now
        if not finished:
            return False
        self.finish_s = now
        self.status = "aborted" if req.finish_reason.to_json()["type"] == "abort" else "finished"
        self.output_len = len(req.output_ids)
        self.retractions = req.retraction_count
        return True


def request_totals(records: list[RequestResult], sim_s: float) -> dict[str, Any]:
    """What became of the requests, in simulated seconds: counts, tokens, latencies."""
    finished = [r for r in records if r.status == "finished"]
    latencies = np.array([r.latency_s for r in finished], dtype=float)
    ttfts = np.array([r.first_token_s - r.arrival for r in finished], dtype=float)
    output_tokens = sum(r.output_len for r in finished)
    return {
        "requests": len(records),
        "finished": len(finished),
        "aborted": sum(r.status == "aborted" for r in records),
        "rejected": sum(r.status == "rejected" for r in records),
        "sim_s": round(sim_s, 6),
        "output_tokens": output_tokens,
        "throughput_tok_s": round(output_tokens / sim_s, 3) if sim_s else 0.0,
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
        "p50_ttft_s": percentile(ttfts, 50),
        "p99_ttft_s": percentile(ttfts, 99),
        "max_retractions_per_request": max((r.retractions for r in records), default=0),
    }


@dataclass
class Series:
    """Per-step samples for plots; ``retracts`` are (time, number of requests retracted)."""

    t: list[float] = field(default_factory=list)
    used: list[int] = field(default_factory=list)  # held by requests (not evictable cache)
    evictable: list[int] = field(default_factory=list)
    swa_used: list[int] = field(default_factory=list)  # a hybrid model's SWA pool (else empty)
    context: list[int] = field(default_factory=list)  # the running requests' tokens
    ratio: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    retracts: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class SimResult:
    settings: dict[str, str]
    totals: dict[str, Any]
    requests: list[RequestResult]
    series: Series
    retract_log: list[RetractEvent]
    capacity: int
    wall_s: float
    outputs: dict[str, list[int]] | None = None

    def summary(self) -> dict[str, Any]:
        """The JSON-friendly part: settings, totals (simulated, deterministic), wall time."""
        num = self.totals["requests"]
        return {
            "settings": self.settings,
            "totals": self.totals,
            "wall_s": round(self.wall_s, 4),
            "wall_req_per_s": round(num / self.wall_s, 1) if self.wall_s else None,
        }


def run(
    spec: SimSpec,
    workload: list[RequestSpec],
    *,
    settings: dict[str, str] | None = None,
    seed: int = 0,
) -> SimResult:
    """Run one simulation to completion (blocking). ``seed`` seeds the prompts."""
    return asyncio.run(run_async(spec, workload, settings=settings, seed=seed))


async def run_async(
    spec: SimSpec,
    workload: list[RequestSpec],
    *,
    settings: dict[str, str] | None = None,
    seed: int = 0,
) -> SimResult:
    config = spec.scheduler_config()
    hybrid = {}
    if spec.is_hybrid:
        hybrid = dict(
            layer_types=spec.layer_types(),
            sliding_window=spec.sliding_window,
            swa_full_tokens_ratio=spec.swa_full_tokens_ratio,
        )
    layout = tiny_layout(
        spec.pool_tokens,
        spec.page_size,
        spec.max_running_requests,
        _context_len(spec, workload),
        **hybrid,
    )
    host_tokens = spec.pool_tokens if spec.host_store_tokens is None else spec.host_store_tokens
    service = build_service(
        layout, host_store_tokens=host_tokens, retract_decode_steps=config.retract_decode_steps
    )
    started = time.perf_counter()
    try:
        sim = Simulation(spec, config, service, workload, seed)
        await sim.start()
        await sim.drive()
        service.pool.check_integrity(idle=True)
        return sim.result(settings or {}, time.perf_counter() - started)
    finally:
        service.pool.close()


def _context_len(spec: SimSpec, workload: list[RequestSpec]) -> int:
    longest = max((r.input_len + r.max_new_tokens for r in workload), default=1)
    return longest + spec.page_size


class Simulation:
    """The state of one run: clock, stack, per-request records, samples."""

    def __init__(
        self,
        spec: SimSpec,
        config: SchedulerConfig,
        service: MemService,
        workload: list[RequestSpec],
        seed: int,
    ) -> None:
        self.spec = spec
        self.config = config
        self.service = service
        self.workload = sorted(workload, key=lambda r: r.arrival)
        self.seed = seed
        self.clock = SimClock()
        self.records = {r.rid: RequestResult(r.rid, r.arrival, r.input_len, 0) for r in workload}
        if len(self.records) != len(workload):
            raise ValueError("request ids in the workload are not unique")
        self.prompts: dict[str, list[int]] = {}
        self.stop_lens: dict[str, int] = {}
        self.series = Series()
        self.outputs: dict[str, list[int]] = {}
        self.num_unservable = 0
        self.num_wrong_outputs = 0

    async def start(self) -> None:
        pool = self.service.pool
        self.mem = await SimMem.connect(self.service, clock=self.clock, cost=self.spec.cost)
        stop = self._stop_lengths if any(r.stops_early for r in self.workload) else None
        table = pool.table.array if self.spec.check_tokens else None
        self.worker = SimWorker(self.clock, self.spec.cost, stop_lengths=stop, table=table)
        self.engine = Engine(
            self.config,
            self.mem,
            self.worker,  # type: ignore[arg-type]  # duck-typed AsyncModelClient
            self._emit,
            eos_token_ids=(EOS,),
            capacity=pool.capacity,
        )
        clock_engine_costs(self.engine, self.clock, self.spec.cost)

    def _stop_lengths(self, rows: Any) -> np.ndarray:
        rid_of_row = self.service.pool.rid_of_row
        return np.array([self.stop_lens[rid_of_row(r)] for r in rows.tolist()], dtype=np.int64)

    # -- the loop --------------------------------------------------------------

    async def drive(self) -> None:
        arrivals = deque(self.workload)
        engine = self.engine
        seen_retracts = 0
        while True:
            while arrivals and arrivals[0].arrival <= self.clock.now:
                self._submit(arrivals.popleft())
            progressed = await engine.step()
            seen_retracts = self._sample(seen_retracts)
            if progressed:
                continue
            if engine.idle:
                if not arrivals:
                    return
                self.clock.wait_until(arrivals[0].arrival)
            elif engine.waiting:
                # Nothing runs and the head of the queue was not admitted into an
                # otherwise empty pool: it never will be. Abort it, as a client would.
                self.num_unservable += 1
                engine.abort(engine.waiting[0].rid)
            else:
                raise RuntimeError("sim: the engine made no progress with nothing waiting")

    def _submit(self, spec: RequestSpec) -> None:
        """The scheduler service's intake, then ``Engine.submit``."""
        record = self.records[spec.rid]
        capacity = self.service.pool.capacity
        try:
            check_fits(spec.input_len, capacity, self.spec.page_size)
            check_swa_fits(
                spec.input_len,
                self.engine.swa,
                mode="normal",
                chunked_prefill_size=self.config.chunked_prefill_size,
            )
        except RequestTooLargeError:
            record.status = "rejected"
            return
        max_new = clamp_max_new_tokens(
            spec.input_len, spec.max_new_tokens, capacity, self.spec.page_size
        )
        record.max_new_tokens = max_new
        if max_new == 0:
            record.status = "rejected"
            return
        prompt = prompt_tokens(spec, self.seed)
        self.prompts[spec.rid] = prompt
        self.stop_lens[spec.rid] = (
            spec.input_len + spec.output_len if spec.output_len < max_new else -1
        )
        params = SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0, "seed": 0})
        self.engine.submit(Req(spec.rid, prompt, params, arrival_time=spec.arrival))

    def _emit(self, req: Req, finished: bool) -> None:
        record = self.records[req.rid]
        if not record.note_reply(req, finished, self.clock.now):
            return
        if self.spec.keep_outputs:
            self.outputs[req.rid] = list(req.output_ids)
        if self.spec.check_tokens and record.status == "finished":
            want = expected_output(
                self.prompts[req.rid], record.max_new_tokens, self.stop_lens[req.rid]
            )
            self.num_wrong_outputs += req.output_ids != want

    def _sample(self, seen_retracts: int) -> int:
        sizes = self.mem.sizes
        series = self.series
        series.t.append(self.clock.now)
        pool = self.service.pool
        series.used.append(pool.capacity - full_available_of(sizes) - sizes.evictable)
        series.evictable.append(sizes.evictable)
        if pool.layout.is_hybrid:
            swa_free = (sizes.swa_available or 0) + (sizes.swa_evictable or 0)
            series.swa_used.append(pool.layout.swa_capacity_tokens - swa_free)
        series.context.append(sum(r.seq_len for r in self.engine.running))
        series.ratio.append(self.engine.ratio.current)
        series.waiting.append(len(self.engine.waiting))
        series.running.append(len(self.engine.running))
        log = self.mem.retracts
        for event in log[seen_retracts:]:
            series.retracts.append((event.time, len(event.retracted)))
        return len(log)

    # -- results ---------------------------------------------------------------

    def result(self, settings: dict[str, str], wall_s: float) -> SimResult:
        return SimResult(
            settings=settings,
            totals=self._totals(),
            requests=list(self.records.values()),
            series=self.series,
            retract_log=list(self.mem.retracts),
            capacity=self.service.pool.capacity,
            wall_s=wall_s,
            outputs=self.outputs if self.spec.keep_outputs else None,
        )

    def _totals(self) -> dict[str, Any]:
        stats = self.engine.stats
        series, layout = self.series, self.service.pool.layout
        swa_capacity = layout.swa_capacity_tokens if layout.is_hybrid else None
        return {
            **request_totals(list(self.records.values()), self.clock.now),
            "retractions": stats.retracted_reqs,
            "retract_events": stats.retract_events,
            "reprefilled_tokens": stats.reprefilled_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "forward_passes": stats.forward_passes,
            "offloaded_tokens": self.mem.offloaded_tokens,
            "loaded_tokens": self.mem.loaded_tokens,
            "copy_s": round(self.clock.copy_s, 6),
            "unservable": self.num_unservable,
            "capacity": self.service.pool.capacity,
            "peak_used": max(series.used, default=0),
            "peak_context": max(series.context, default=0),
            "peak_running": max(series.running, default=0),
            "swa_capacity": swa_capacity,
            "peak_swa_used": max(series.swa_used, default=0) if swa_capacity else None,
            "wrong_outputs": self.num_wrong_outputs if self.spec.check_tokens else None,
        }


def percentile(values: np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile of ``values``, rounded (None: no values)."""
    return round(float(np.percentile(values, q)), 6) if values.size else None
