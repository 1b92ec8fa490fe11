"""Whole simulations: determinism, retract pressure, outputs, the copy hook, and agreement
with the engine tests' in-process stack (so the simulator adds no policy of its own)."""

from __future__ import annotations

import asyncio
from dataclasses import fields, replace

import pytest

from kvstack.sim import runner
from kvstack.sim.costmodel import CostModel, SimClock
from kvstack.sim.inproc import SimMem, build_service, tiny_layout
from kvstack.sim.settings import SimSpec, expand_sweeps, parse_sweep
from kvstack.sim.worker import EOS, expected_output
from kvstack.sim.workload import RequestSpec, prompt_tokens, synthetic
from memsvc.client import RetractTarget
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from scheduler_svc.core import Req, SamplingParams, SchedulerConfig, clamp_max_new_tokens
from scheduler_svc.engine import Engine
from tests.helpers import small_layout
from tests.scheduler.engine_harness import FakeModel, InProcessMem

# 1024 tokens of KV for 40 requests of ~150 tokens each, admitted optimistically (a low
# new-token ratio that decays fast): the pool is under pressure most of the run.
PRESSURE = SimSpec(
    pool_tokens=1024,
    page_size=4,
    max_running_requests=16,
    config={"schedule_conservativeness": 0.3, "new_token_ratio_decay_steps": 50},
    check_tokens=True,
)


def pressure_workload(seed: int = 7, **kw) -> list[RequestSpec]:
    kw = {"input_len": "uniform:8:40", "output_len": "uniform:60:200", **kw}
    return synthetic(40, seed=seed, **kw)


def test_same_seed_same_figures() -> None:
    workload = pressure_workload(rate=20.0)
    first = runner.run(PRESSURE, workload, seed=1)
    again = runner.run(PRESSURE, workload, seed=1)
    assert first.totals == again.totals
    assert first.retract_log == again.retract_log
    assert first.series.t == again.series.t
    assert first.totals["retractions"] > 0  # the figures compared are not all zero
    other = runner.run(PRESSURE, pressure_workload(seed=8, rate=20.0), seed=1)
    assert other.totals != first.totals


def test_pressure_retracts_and_every_request_gets_its_deterministic_tokens() -> None:
    workload = pressure_workload(max_new_factor=1.5)  # some stop early, on EOS
    result = runner.run(replace(PRESSURE, keep_outputs=True), workload, seed=2)
    totals = result.totals
    assert totals["retractions"] > 0 and totals["reprefilled_tokens"] > 0
    assert totals["finished"] == 40 and totals["aborted"] == totals["rejected"] == 0
    assert totals["wrong_outputs"] == 0
    assert totals["max_retractions_per_request"] == max(r.retractions for r in result.requests)
    assert sum(r.retractions for r in result.requests) == totals["retractions"]
    assert sum(len(e.retracted) for e in result.retract_log) == totals["retractions"]
    for spec in workload:  # checked here too, independently of the runner's own check
        stop = spec.input_len + spec.output_len if spec.stops_early else -1
        want = expected_output(prompt_tokens(spec, 2), spec.max_new_tokens, stop)
        assert result.outputs[spec.rid] == want, spec.rid
        assert len(want) == spec.output_len and (want[-1] == EOS) == spec.stops_early
    latencies = [r.latency_s for r in result.requests]
    assert all(lat > 0 for lat in latencies)
    assert max(latencies) == pytest.approx(totals["sim_s"])  # all arrive at t=0
    assert totals["p50_latency_s"] <= totals["p99_latency_s"] <= totals["sim_s"] + 1e-6
    assert len(result.series.retracts) == totals["retract_events"]


def test_the_pool_is_intact_and_idle_after_a_run() -> None:
    workload = pressure_workload()
    spec = PRESSURE.scheduler_config()

    async def scenario() -> MemService:
        layout = tiny_layout(1024, 4, 16, runner._context_len(PRESSURE, workload))
        service = build_service(layout, host_store_tokens=1024)
        sim = runner.Simulation(PRESSURE, spec, service, workload, seed=0)
        await sim.start()
        await sim.drive()
        assert sim.engine.stats.retracted_reqs > 0 and sim.engine.idle
        return service

    service = asyncio.run(scenario())
    try:
        service.pool.check_integrity(idle=True)
        assert service.pool.available_size() + service.pool.evictable_size() == 1024
    finally:
        service.pool.close()


def test_requests_that_can_never_fit_are_rejected_not_hung() -> None:
    workload = [RequestSpec("huge", 0.0, 5000, 4, 4), RequestSpec("ok", 0.0, 10, 4, 4)]
    result = runner.run(PRESSURE, workload)
    status = {r.rid: r.status for r in result.requests}
    assert status == {"huge": "rejected", "ok": "finished"}


def test_a_sweep_gives_one_result_per_combination() -> None:
    runs = expand_sweeps(
        PRESSURE,
        [parse_sweep("schedule_conservativeness=0.3,3"), parse_sweep("retract_decode_steps=5,40")],
    )
    workload = pressure_workload(max_new_factor=3.0)
    results = [runner.run(spec, workload, settings=s) for s, spec in runs]
    assert len(results) == 4
    assert [r.settings for r in results] == [s for s, _ in runs]
    assert all(r.totals["finished"] == 40 for r in results)
    assert all(r.totals["wrong_outputs"] == 0 for r in results)
    # each knob reaches the engine: the conservativeness changes the schedule, the
    # retract-decode steps the ratio assigned after a retract
    assert results[0].totals["sim_s"] != results[2].totals["sim_s"]
    assert results[0].totals["retractions"] > 0
    assert results[0].series.ratio != results[1].series.ratio


HAS_RETRACT_MODE = "retract_mode" in {f.name for f in fields(SchedulerConfig)}
needs_retract_mode = pytest.mark.skipif(
    not HAS_RETRACT_MODE, reason="SchedulerConfig.retract_mode is not there yet"
)


def test_cost_retraction_policy_picks_other_victims_and_keeps_outputs() -> None:
    runs = expand_sweeps(PRESSURE, [parse_sweep("retraction_policy=length,cost")])
    results = {
        s["retraction_policy"]: runner.run(replace(spec, keep_outputs=True), pressure_workload())
        for s, spec in runs
    }
    length, cost = results["length"], results["cost"]
    assert length.totals["retractions"] > 0 and cost.totals["retractions"] > 0
    assert [e.retracted for e in length.retract_log] != [e.retracted for e in cost.retract_log]
    for result in (length, cost):
        assert result.totals["wrong_outputs"] == 0
        assert result.totals["finished"] == 40 and result.totals["aborted"] == 0
    assert cost.outputs == length.outputs  # greedy: the victims change, the tokens do not


@needs_retract_mode
def test_retract_mode_sweep_charges_copies_for_offload() -> None:
    runs = expand_sweeps(PRESSURE, [parse_sweep("retract_mode=recompute,offload,auto")])
    results = {s["retract_mode"]: runner.run(spec, pressure_workload()) for s, spec in runs}
    recompute, offload = results["recompute"].totals, results["offload"].totals
    assert recompute["copy_s"] == 0 and recompute["retractions"] > 0
    assert offload["offloaded_tokens"] > 0 and offload["loaded_tokens"] > 0
    moved = offload["offloaded_tokens"] + offload["loaded_tokens"]
    cost = PRESSURE.cost
    expected_s = moved * cost.bytes_per_token / cost.copy_bytes_per_s
    assert offload["copy_s"] == pytest.approx(expected_s, abs=1e-6)  # rounded to the µs
    assert offload["reprefilled_tokens"] < recompute["reprefilled_tokens"]
    assert all(r.totals["wrong_outputs"] == 0 for r in results.values())
    # auto learns its rates from the simulated clock: the same run gives the same figures
    auto_spec = runs[2][1]
    assert runner.run(auto_spec, pressure_workload()).totals == results["auto"].totals


def test_sim_mem_charges_offload_and_load_copies_from_the_cost_model() -> None:
    cost = CostModel(bytes_per_token=1000, copy_bytes_per_s=1e6)  # 1 ms per token
    service = build_service(tiny_layout(256, 4, 8, 64), host_store_tokens=256)
    clock = SimClock()

    async def scenario() -> None:
        mem = await SimMem.connect(service, clock=clock, cost=cost)
        rows = []
        for rid, n in (("a", 10), ("b", 30)):
            rows.append(await mem.alloc_row(rid))
            assert (await mem.alloc_extend([(rid, n)])).fits
        reply = await mem.retract(rows, [RetractTarget.HOST_ENTRY] * 2)  # "b" goes first
        assert reply.retracted == ["b"]
        assert clock.copy_s == pytest.approx(0.030) and mem.offloaded_tokens == 30
        assert [(e.targets, e.retracted, e.offloaded_tokens) for e in mem.retracts] == [
            (("host_entry", "host_entry"), ("b",), 30)
        ]
        await mem.alloc_row("b")
        assert (await mem.load("b")).fits
        assert mem.loaded_tokens == 30 and clock.copy_s == pytest.approx(0.060)
        await mem.offload("a")
        assert mem.offloaded_tokens == 40 and clock.now == pytest.approx(0.070)
        await mem.retract([rows[0], (await mem.alloc_row("c"))], [RetractTarget.FREE] * 2)
        assert mem.retracts[-1].offloaded_tokens == 0 and clock.copy_s == pytest.approx(0.070)

    try:
        asyncio.run(scenario())
    finally:
        service.pool.close()


# -- the simulator and the real stack agree -------------------------------------


class RecordingMem(InProcessMem):
    """The engine tests' memsvc client, noting which requests each retract released."""

    retracted: list[str]

    async def retract(self, rows, *args, **kwargs):
        reply = await super().retract(rows, *args, **kwargs)
        self.retracted.extend(reply.retracted)
        return reply


async def run_on_harness(spec: SimSpec, workload: list[RequestSpec], seed: int):
    """The same requests through the Engine with test_engine.py's stack (FakeModel)."""
    config = spec.scheduler_config()
    layout = small_layout(
        page_size=spec.page_size,
        num_pages=spec.pool_tokens // spec.page_size,
        max_running_requests=spec.max_running_requests,
        max_context_len=runner._context_len(spec, workload),
    )
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        service = MemService(pool, ServiceConfig(retract_decode_steps=config.retract_decode_steps))
        mem = await RecordingMem.connect(service)
        mem.retracted = []
        done: dict[str, Req] = {}
        engine = Engine(
            config,
            mem,
            FakeModel(pool.table.array),
            lambda req, finished: done.__setitem__(req.rid, req) if finished else None,
            eos_token_ids=(EOS,),
            capacity=pool.capacity,
        )
        for r in workload:
            max_new = clamp_max_new_tokens(r.input_len, r.max_new_tokens, pool.capacity, 4)
            params = SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0, "seed": 0})
            engine.submit(Req(r.rid, prompt_tokens(r, seed), params))
        for _ in range(100_000):
            if not await engine.step() and engine.idle:
                break
        pool.check_integrity(idle=True)
        return engine.stats, mem.retracted, {rid: req.output_ids for rid, req in done.items()}
    finally:
        pool.close()


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="kv-pressure"),
        pytest.param({"test_retract": True, "test_retract_interval": 3}, id="test-retract"),
        pytest.param({"chunked_prefill_size": 16}, id="chunked"),
        pytest.param({"retract_mode": "offload"}, id="offload", marks=needs_retract_mode),
        # Victims by cost: under recompute or offload the order does not depend on the
        # learned rates (one common factor), so wall and simulated clocks agree on it.
        pytest.param({"retraction_policy": "cost"}, id="cost-recompute"),
        pytest.param({"retraction_policy": "cost", "retract_mode": "offload"}, id="cost-offload"),
    ],
)
def test_the_simulator_and_the_real_stack_agree(config) -> None:
    spec = replace(PRESSURE, config={**PRESSURE.config, **config}, keep_outputs=True)
    workload = pressure_workload()  # all at t=0: both stacks see the same submissions
    sim = runner.run(spec, workload, seed=5)
    stats, retracted, outputs = asyncio.run(run_on_harness(spec, workload, seed=5))
    assert stats.retracted_reqs > 0
    assert sim.totals["retractions"] == stats.retracted_reqs
    assert sim.totals["retract_events"] == stats.retract_events
    assert [rid for e in sim.retract_log for rid in e.retracted] == retracted
    assert sim.totals["reprefilled_tokens"] == stats.reprefilled_tokens
    assert sim.totals["forward_passes"] == stats.forward_passes
    assert sim.outputs == outputs
