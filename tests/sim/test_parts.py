"""The simulator's pure parts: cost model, workloads, traces, settings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstack.sim.costmodel import CostModel, parse_decode_points
from kvstack.sim.settings import SimSpec, apply_setting, expand_sweeps, parse_sweep
from kvstack.sim.worker import EOS, expected_output, next_token
from kvstack.sim.workload import LengthDist, load_trace, prompt_tokens, synthetic
from scheduler_svc.core import ConfigError

# bench/model_step.py on this CPU: prefill tokens/s by prompt length, decode ms by batch.
BENCH_PREFILL = {512: 15_000, 2048: 10_800, 8192: 5_600}
BENCH_DECODE_MS = {1: 4.3, 16: 14.3, 64: 50.8}


def test_default_costs_reproduce_the_bench_figures() -> None:
    cost = CostModel()
    for n, tok_per_s in BENCH_PREFILL.items():
        assert n / cost.prefill_seconds([(0, n)]) == pytest.approx(tok_per_s, rel=0.03)
    for batch, ms in BENCH_DECODE_MS.items():
        assert cost.decode_seconds(batch) == pytest.approx(ms / 1000)
    # between points: linear; beyond the last: along the last segment
    assert cost.decode_seconds(40) == pytest.approx((14.3 + (50.8 - 14.3) / 2) / 1000)
    assert cost.decode_seconds(112) == pytest.approx((50.8 + (50.8 - 14.3)) / 1000)


def test_prefill_after_a_prefix_costs_its_context_and_copies_cost_bandwidth() -> None:
    cost = CostModel(prefill_tok_per_s=1000.0, prefill_s_per_token_context=1e-6)
    # 4 new tokens after 10: context 10 + 11 + 12 + 13 = 46 token-pairs
    assert cost.prefill_seconds([(10, 4)]) == pytest.approx(4 / 1000 + 46e-6)
    assert cost.prefill_seconds([(10, 4), (0, 1)]) == pytest.approx(4 / 1000 + 46e-6 + 1 / 1000)
    copy = CostModel(bytes_per_token=1000, copy_bytes_per_s=1e6)
    assert copy.copy_seconds(500) == pytest.approx(0.5)


def test_cost_overrides_from_json_and_flags(tmp_path) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(
        json.dumps({"prefill_tok_per_s": 2e4, "decode_points": [[1, 0.01], [256, 0.03]]})
    )
    cost = CostModel.from_json(path)
    assert cost.prefill_tok_per_s == 2e4 and cost.decode_points == ((1, 0.01), (256, 0.03))
    assert cost.decode_seconds(256) == pytest.approx(0.03)
    assert parse_decode_points("1:4,8:10") == ((1, 0.004), (8, 0.01))
    with pytest.raises(ValueError, match="unknown cost model fields"):
        cost.with_values({"prefill_speed": 1})
    with pytest.raises(ValueError, match="ascending"):
        CostModel(decode_points=((8, 0.1), (4, 0.05)))


def test_synthetic_workload_is_seeded() -> None:
    a = synthetic(200, input_len="uniform:10:20", output_len="exp:30", rate=50.0, seed=3)
    assert a == synthetic(200, input_len="uniform:10:20", output_len="exp:30", rate=50.0, seed=3)
    assert a != synthetic(200, input_len="uniform:10:20", output_len="exp:30", rate=50.0, seed=4)
    arrivals = np.array([r.arrival for r in a])
    assert (np.diff(arrivals) > 0).all()
    assert 200 / arrivals[-1] == pytest.approx(50.0, rel=0.25)  # Poisson at the rate
    assert all(10 <= r.input_len <= 20 and r.output_len >= 1 for r in a)
    burst = synthetic(5, input_len="64", output_len="8", max_new_factor=2.5)
    assert [(r.arrival, r.input_len, r.output_len, r.max_new_tokens) for r in burst] == [
        (0.0, 64, 8, 20)
    ] * 5
    assert prompt_tokens(burst[0]) == prompt_tokens(burst[0]) != prompt_tokens(burst[1])


def test_length_distributions_parse_and_reject() -> None:
    rng = np.random.default_rng(0)
    assert set(LengthDist.parse("choice:4,8").sample(rng, 100).tolist()) == {4, 8}
    assert LengthDist.parse("normal:-50:1").sample(rng, 10).min() == 1  # never below 1
    with pytest.raises(ValueError):
        LengthDist.parse("uniform:4")


def test_trace_loading(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"arrival": 2.5, "input_len": 30, "output_len": 5}\n'
        "# a comment, then a blank line\n\n"
        '{"arrival": 0.5, "input_len": 7, "output_len": 9, "max_new_tokens": 20, "rid": "x"}\n'
    )
    specs = load_trace(path)
    assert [(s.rid, s.arrival, s.input_len, s.output_len, s.max_new_tokens) for s in specs] == [
        ("x", 0.5, 7, 9, 20),
        ("t1", 2.5, 30, 5, 5),
    ]
    assert specs[0].stops_early and not specs[1].stops_early
    path.write_text('{"arrival": 0, "input_len": 3}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        load_trace(path)


def test_expected_output_places_eos_at_the_stop_length() -> None:
    prompt = [5, 6, 7]
    full = expected_output(prompt, 6)
    assert full[0] == next_token(7, 2) and EOS not in full and len(full) == 6
    early = expected_output(prompt, 6, stop_len=3 + 4)
    assert early == [*full[:3], EOS]


def test_settings_route_to_pool_config_and_cost() -> None:
    spec = SimSpec()
    spec = apply_setting(spec, "pool_tokens", "5000")
    spec = apply_setting(spec, "schedule_conservativeness", "0.5")
    spec = apply_setting(spec, "chunked_prefill_size", "256")
    spec = apply_setting(spec, "test_retract", "true")
    spec = apply_setting(spec, "copy_bytes_per_s", "1e9")
    assert spec.pool_tokens == 5000 and spec.cost.copy_bytes_per_s == 1e9
    assert spec.config == {
        "schedule_conservativeness": 0.5,
        "chunked_prefill_size": 256,
        "test_retract": True,
    }
    config = spec.scheduler_config()
    assert config.schedule_conservativeness == 0.5 and config.test_retract is True
    with pytest.raises(ValueError, match="unknown setting 'no_such_field'"):
        apply_setting(spec, "no_such_field", "1")
    with pytest.raises(ValueError, match="test_retract=maybe"):
        apply_setting(spec, "test_retract", "maybe")


def test_sweeps_expand_to_the_cartesian_product_and_validate_first() -> None:
    runs = expand_sweeps(
        SimSpec(),
        [parse_sweep("schedule_conservativeness=0.5,1,2"), parse_sweep("page_size=4,16")],
    )
    assert [s for s, _ in runs] == [
        {"schedule_conservativeness": c, "page_size": p}
        for c in ("0.5", "1", "2")
        for p in ("4", "16")
    ]
    assert [spec.page_size for _, spec in runs] == [4, 16] * 3
    with pytest.raises(ConfigError):  # the last value is bad: nothing runs
        expand_sweeps(SimSpec(), [parse_sweep("schedule_conservativeness=1,-1")])
