"""``kvstack sim`` on a hybrid (sliding-window) model: memsvc's two pools, the engine's SWA
budgets, every output checked, both pools integrity-checked idle at the end of each run
(the runner does it); and the second pool in the table and the JSON."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvstack.cli import main
from kvstack.sim import runner
from kvstack.sim.settings import SimSpec, apply_setting, expand_sweeps, parse_sweep
from kvstack.sim.workload import synthetic

WINDOW = 32
# Long contexts (8-16 windows of prompt): a hybrid model's full pool fills with whole
# contexts, its SWA pool with a window (and a page or two) per request.
HYBRID = SimSpec(
    pool_tokens=2400,
    page_size=4,
    max_running_requests=64,
    sliding_window=WINDOW,
    swa_full_tokens_ratio=0.25,
    check_tokens=True,
)


def long_workload(count: int = 40, seed: int = 3):
    return synthetic(count, input_len="uniform:256:512", output_len="uniform:32:96", seed=seed)


def test_a_hybrid_run_keeps_both_pools_and_every_output() -> None:
    result = runner.run(HYBRID, long_workload(), seed=1)
    totals = result.totals
    assert totals["finished"] == 40 and totals["wrong_outputs"] == 0
    assert totals["aborted"] == totals["rejected"] == 0
    # 2400 tokens of 6 layers = 1 full layer + 5 at ratio 0.25: 6400 full, 1600 SWA
    assert totals["capacity"] == 6400 and totals["swa_capacity"] == 1600
    assert 0 < totals["peak_used"] <= totals["capacity"]
    assert 0 < totals["peak_swa_used"] <= totals["swa_capacity"]
    assert len(result.series.swa_used) == len(result.series.t)
    # a window per decoding request: far less SWA held than context
    assert totals["peak_swa_used"] < totals["peak_context"] / 2


def test_in_the_same_bytes_the_hybrid_holds_several_times_the_context() -> None:
    workload = long_workload()
    hybrid = runner.run(HYBRID, workload, seed=1).totals
    all_full = runner.run(replace(HYBRID, sliding_window=0), workload, seed=1).totals
    assert all_full["swa_capacity"] is None and all_full["peak_swa_used"] is None
    assert all_full["capacity"] == 2400
    assert hybrid["peak_context"] > 2 * all_full["peak_context"]
    assert hybrid["peak_running"] > 2 * all_full["peak_running"]
    assert hybrid["sim_s"] < all_full["sim_s"]
    # SGLang's default ratio leaves the full pool 1.2x the all-full one: little gained
    default = runner.run(replace(HYBRID, swa_full_tokens_ratio=0.8), workload, seed=1).totals
    assert default["capacity"] == 2880
    assert default["peak_context"] < 1.5 * all_full["peak_context"]


def test_a_small_hybrid_pool_retracts_and_outputs_stay_right() -> None:
    spec = replace(
        HYBRID,
        pool_tokens=1200,
        config={"schedule_conservativeness": 0.3, "new_token_ratio_decay_steps": 50},
    )
    workload = synthetic(30, input_len="uniform:64:160", output_len="uniform:96:192", seed=5)
    totals = runner.run(spec, workload, seed=2).totals
    assert totals["retractions"] > 0 and totals["reprefilled_tokens"] > 0
    assert totals["finished"] == 30 and totals["wrong_outputs"] == 0


def test_hybrid_settings_and_sweeps() -> None:
    spec = apply_setting(SimSpec(), "sliding_window", "64")
    spec = apply_setting(spec, "swa_full_tokens_ratio", "0.3")
    spec = apply_setting(spec, "swa_layers", "6")
    assert (spec.sliding_window, spec.swa_full_tokens_ratio, spec.swa_layers) == (64, 0.3, 6)
    assert spec.layer_types() == ("sliding_attention",) * 6  # pure SWA
    assert spec.is_hybrid and not SimSpec().is_hybrid
    runs = expand_sweeps(spec, [parse_sweep("swa_full_tokens_ratio=0.2,0.8")])
    assert [s.swa_full_tokens_ratio for _, s in runs] == [0.2, 0.8]
    with pytest.raises(ValueError, match="swa_layers=7"):
        replace(spec, swa_layers=7).layer_types()


def test_the_cli_shows_the_second_pool(capsys) -> None:
    argv = [
        "sim", "--requests", "20", "--input-len", "uniform:256:512", "--output-len",
        "uniform:32:64", "--pool-tokens", "2400", "--page-size", "4", "--sliding-window",
        str(WINDOW), "--sweep", "swa_full_tokens_ratio=0.25,0.8", "--check", "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["hybrid"] == {
        "sliding_window": WINDOW,
        "swa_layers": 5,
        "num_layers": 6,
        "swa_full_tokens_ratio": 0.8,
    }
    swa = [r["totals"]["swa_capacity"] for r in report["results"]]
    assert swa == [1600, 2304]
    assert all(r["totals"]["wrong_outputs"] == 0 for r in report["results"])
    assert "hybrid: window 32 on 5 of 6 layers" in out
    table = out[out.index("kvstack sim (simulated time)") :]
    assert "SWA" in table  # the SWA peak column
