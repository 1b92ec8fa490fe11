"""The demo's table learns a hybrid model's second pool (issue 29, item 6): the sampler reads
each pool's own free tokens off memsvc's replies, and the table shows the SWA pool's size
and peak only when a run had one."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from kvstack.demo.report import render_table, summarize
from kvstack.demo.runs import RunResult, Sample, Sampler
from memsvc.ops import PoolSizes


def table_text(summaries: dict) -> str:
    console = Console(width=200, record=True)
    console.print(render_table(summaries))
    return console.export_text()


def run(name: str, samples: list[Sample], swa_capacity: int | None) -> RunResult:
    stats = dict.fromkeys(
        ("retract_events", "retracted_reqs", "reprefilled_tokens", "offloaded_tokens"), 0
    )
    return RunResult(
        name=name,
        outputs={"a": [1, 2]},
        finish_reasons={"a": {"type": "length", "length": 2}},
        latencies=[0.5],
        seconds=1.0,
        stats={**stats, "loaded_tokens": 0},
        bytes_per_token=64,
        capacity=1000,
        swa_capacity=swa_capacity,
        samples=samples,
    )


def sample(used: int, swa_used: int | None) -> Sample:
    return Sample(0.0, used, 0, 0.5, {"running": 1, "waiting": 0}, 0, swa_used)


def test_the_table_shows_the_swa_pool_only_for_a_hybrid_run() -> None:
    hybrid = run("hybrid", [sample(100, 40), sample(700, 90), sample(300, 60)], 240)
    full = run("reference", [sample(200, None), sample(400, None)], None)
    s = summarize(hybrid)
    assert (s["peak_used"], s["capacity"]) == (700, 1000)
    assert (s["peak_swa_used"], s["swa_capacity"]) == (90, 240)
    r = summarize(full)
    assert r["peak_used"] == 400 and r["peak_swa_used"] is None and r["swa_capacity"] is None
    text = table_text({"hybrid": s, "reference": r})
    swa_row = next(line for line in text.splitlines() if "peak SWA tokens held" in line)
    assert "90" in swa_row and "-" in swa_row
    assert "SWA pool tokens" in text
    assert "SWA" not in table_text({"reference": r})


def test_the_sampler_reads_each_pools_own_free_tokens() -> None:
    sampler = Sampler.__new__(Sampler)
    sampler.capacity, sampler.swa_capacity, sampler.t0 = 1000, 240, 0.0
    sampler.samples, sampler.on_sample = [], lambda s: None
    # a hybrid reply: available is the smaller pool's (min), each pool reports its own
    sizes = PoolSizes(
        available=100,
        evictable=30,
        protected=0,
        full_available=600,
        swa_available=100,
        swa_evictable=20,
        swa_protected=0,
    )
    sampler.mem = SimpleNamespace(heartbeat=lambda: None, sizes=sizes)
    info = {
        "new_token_ratio": 0.4,
        "num_running": 2,
        "num_waiting": 1,
        "stats": {"retract_events": 3},
    }
    sampler.sched = SimpleNamespace(info=lambda: info)
    sampler.sample()
    (got,) = sampler.samples
    assert (got.used, got.swa_used, got.evictable) == (400, 140, 30)
    sampler.swa_capacity = None  # one pool: available is the pool's
    sampler.mem.sizes = PoolSizes(available=250, evictable=10, protected=0)
    sampler.sample()
    assert (sampler.samples[-1].used, sampler.samples[-1].swa_used) == (750, None)
