"""``kvstack sim --skew``: two PD decode nodes, every request to the hot one (issue 32).

The real DecodeEngine on each node; the simulator times the prefill node and
the moves. With ``migrate=on`` the hot node moves retracted requests to the
cold one: every request still gets its deterministic tokens (``--check``), both
pools end idle and intact (the runner checks), and the moved requests are
retracted ones the hot node did not have to wait on.
"""

from __future__ import annotations

import json

import pytest

from kvstack.cli import main
from kvstack.sim import pair
from kvstack.sim.settings import SimSpec, apply_setting
from kvstack.sim.workload import synthetic


def skewed(requests: int = 60, pool_tokens: int = 6000) -> tuple[SimSpec, list]:
    workload = synthetic(
        requests, input_len="uniform:64:512", output_len="uniform:32:256", rate=None, seed=3
    )
    spec = SimSpec(pool_tokens=pool_tokens, page_size=16, check_tokens=True)
    return apply_setting(spec, "num_reserved_decode_tokens", "16"), workload


@pytest.fixture(scope="module")
def runs() -> dict[bool, pair.SimResult]:
    spec, workload = skewed()
    return {m: pair.run(spec, workload, migrate=m, seed=3) for m in (False, True)}


@pytest.mark.parametrize("migrate", [False, True])
def test_every_request_finishes_with_its_tokens(runs, migrate: bool) -> None:
    totals = runs[migrate].totals
    assert totals["finished"] == totals["requests"] == 60
    assert totals["wrong_outputs"] == 0 and totals["aborted"] == 0
    assert totals["reprefilled_tokens"] == 0  # a decode node offloads; nothing recomputed


def test_the_hot_node_retracts_and_keeps_its_victims_without_a_peer(runs) -> None:
    static = runs[False].totals
    assert static["retractions"] > 0, "the pool never ran short: the test shows nothing"
    assert static["migrated_reqs"] == 0
    assert static["loaded_tokens"] == static["offloaded_tokens"]  # each loaded back here


def test_with_a_peer_the_victims_move_instead(runs) -> None:
    static, moved = runs[False].totals, runs[True].totals
    assert 0 < moved["migrated_reqs"] <= moved["retractions"]
    assert moved["migrated_tokens"] > 0
    # what moved was not loaded back here: fewer loads than offloads
    assert moved["loaded_tokens"] < moved["offloaded_tokens"]
    assert moved["p50_latency_s"] < static["p50_latency_s"]


def test_same_seed_same_figures() -> None:
    spec, workload = skewed(requests=20, pool_tokens=3000)
    first = pair.run(spec, workload, migrate=True, seed=1).totals
    assert pair.run(spec, workload, migrate=True, seed=1).totals == first


def test_the_command_prints_both_runs_and_the_speedups(capsys) -> None:
    argv = ["sim", "--skew", "--requests", "40", "--pool-tokens", "4000"]
    argv += ["--input-len", "uniform:64:512", "--output-len", "uniform:32:256"]
    assert main([*argv, "--set", "num_reserved_decode_tokens=16", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["settings"] for r in report["results"]] == [{"migrate": "off"}, {"migrate": "on"}]
    (row,) = report["skew"]
    assert row["migrated_reqs"] == report["results"][1]["totals"]["migrated_reqs"]
    assert row["p50_latency_speedup"] > 0


def test_a_hybrid_pool_is_refused(capsys) -> None:
    assert main(["sim", "--skew", "--requests", "2", "--sliding-window", "64"]) == 2
    assert "hybrid pool does not move" in capsys.readouterr().err
