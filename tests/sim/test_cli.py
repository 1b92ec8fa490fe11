"""``kvstack sim`` end to end: the command of docs/sim.md, traces, cost files, bad input."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvstack.cli import main

POLICY_LAB = Path(__file__).resolve().parents[2] / "docs" / "sim.md"


def readme_command() -> list[str]:
    """The ``kvstack sim`` example of the policy-lab page, as argv."""
    text = POLICY_LAB.read_text()
    section = text[text.index("# Policy lab (kvstack sim)") :]
    line = next(ln for ln in section.splitlines() if ln.startswith("kvstack sim "))
    return shlex.split(line)[1:]


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_the_readme_example_runs_and_prints_json_last(tmp_path, capsys) -> None:
    argv = readme_command()
    argv[argv.index("--plots") + 1] = str(tmp_path / "plots")
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = last_json(out)
    results = report["results"]
    assert [r["settings"] for r in results] == [
        {"schedule_conservativeness": "0.3"},
        {"schedule_conservativeness": "1.0"},
    ]
    for r in results:
        totals = r["totals"]
        assert totals["finished"] == report["workload"]["requests"] == 40
        assert totals["throughput_tok_s"] > 0 and totals["p99_latency_s"] > 0
    assert results[0]["totals"]["retractions"] > 0
    assert all(r["totals"]["wrong_outputs"] == 0 for r in results)  # --check
    assert "schedule_conservativeness=0.3" in out  # the table
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["sweep.png", "timeline-00.png", "timeline-01.png"]
    assert all((tmp_path / "plots" / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_trace_and_cost_file(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps({"arrival": i * 0.01, "input_len": 20 + i, "output_len": 10})
            for i in range(6)
        )
    )
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"decode_points": [[1, 0.5]]}))  # 0.5 s per step, any batch
    argv = ["sim", "--trace", str(trace), "--cost", str(cost), "--prefill-tok-per-s", "1e9"]
    assert main([*argv, "--pool-tokens", "4096", "--page-size", "4", "--json"]) == 0
    report = last_json(capsys.readouterr().out)
    assert report["workload"] == {
        "requests": 6,
        "trace": str(trace),
        "seed": 0,
        "input_tokens": sum(20 + i for i in range(6)),
        "output_tokens": 60,
    }
    assert report["cost"]["decode_points"] == [[1, 0.5]]
    totals = report["results"][0]["totals"]
    # every request decodes 9 steps after its prefill; at 0.5 s a step, ~4.5 s in all
    assert totals["finished"] == 6 and totals["output_tokens"] == 60
    assert 4.5 <= totals["sim_s"] < 6.0


def test_retraction_policy_sweep_runs_length_and_cost(capsys) -> None:
    argv = ["sim", "--requests", "40", "--pool-tokens", "1024", "--page-size", "4"]
    argv += ["--max-running-requests", "16", "--input-len", "uniform:8:40"]
    argv += ["--output-len", "uniform:60:200", "--set", "schedule_conservativeness=0.3"]
    argv += ["--set", "new_token_ratio_decay_steps=50", "--check", "--json"]
    assert main([*argv, "--sweep", "retraction_policy=length,cost"]) == 0
    results = last_json(capsys.readouterr().out)["results"]
    assert [r["settings"] for r in results] == [
        {"retraction_policy": "length"},
        {"retraction_policy": "cost"},
    ]
    for r in results:
        assert r["totals"]["retractions"] > 0 and r["totals"]["wrong_outputs"] == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "no_such_knob=1"], "unknown setting 'no_such_knob'"),
        (["--sweep", "schedule_conservativeness=1,-2"], "schedule_conservativeness must be >= 0"),
        (["--input-len", "uniform:5"], "bad length distribution"),
        (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
        (["--sweep", "retraction_policy=length,cheapest"], "retraction_policy must be one of"),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys) -> None:
    assert main(["sim", "--requests", "2", *argv]) == 2
    assert message in capsys.readouterr().err
