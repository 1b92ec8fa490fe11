"""bench/hicache.py end to end at --quick sizes: what it prints, not how fast.

One run of the tiny matrix (the tiny model; every workload, a roomy and a tight
pool) serves every cell on two real stacks, whose pools the bench checks
(memsvc's integrity check, idle) before it stops them; the tests read the last
stdout line's JSON: its shape, that the hierarchy and radix-only replied token
for token alike, that the figures add up (every prompt token a hit or
computed), that the no-reuse control hit nothing, and that on a roomy pool
(nothing evicted) both stacks computed the same prompt tokens: a round's first
chat opens it alone, so the others' first turns always hit the shared prompt
(sent together, how they batched decided whether each computed it). How many
tokens hit on a tight pool is each cache's business; wall-clock figures are the
benchmark's, not a test's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
TOP_KEYS = (
    "worst_ttft_p50_speedup",
    "best_ttft_p50_speedup",
    "worst_throughput_ratio",
    "best_throughput_ratio",
    "all_outputs_identical",
    "machine",
    "cells",
    "leaked_segments",
)
STACK_KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "requests_per_s",
    "output_tokens_per_s",
    "prefill_tokens",
    "hit_tokens",
)


def load_bench(name: str = "hicache") -> ModuleType:
    sys.path.insert(0, str(BENCH))  # its sibling modules, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    bench = load_bench()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(["--quick"])  # exits non-zero on differing replies or leaked memory
    return json.loads(out.getvalue().strip().splitlines()[-1])


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_json_has_every_cell_and_the_matrix_figures(quick: dict[str, Any]) -> None:
    assert all(key in quick for key in TOP_KEYS)
    assert quick["machine"]["cores"] >= 1 and "cpu" in quick["machine"]
    kinds = {c["workload"] for c in quick["cells"]}
    assert kinds == {"docs", "chat", "agent", "unique"}
    docs = [c for c in quick["cells"] if c["workload"] == "docs"]
    assert (
        min(c["working_set_over_pool"] for c in docs)
        < 1
        < max(c["working_set_over_pool"] for c in docs)
    )  # a roomy pool and a tight one
    speedups = [c["ttft_p50_speedup"] for c in quick["cells"]]
    ratios = [c["throughput_ratio"] for c in quick["cells"]]
    assert quick["worst_ttft_p50_speedup"] == min(speedups)
    assert quick["best_ttft_p50_speedup"] == max(speedups)
    assert quick["worst_throughput_ratio"] == min(ratios)
    for cell in quick["cells"]:
        for name in ("hicache", "radix"):
            figures = cell[name]
            assert all(key in figures for key in STACK_KEYS)
            assert all(positive(figures[k]) for k in STACK_KEYS[:5])
            # each stack served every round (their spread is reported)
            assert len(figures["round_ttft_p50_s"]) == len(figures["round_wall_s"]) == 2
            # what each service's process spent, the worker's round by round
            assert set(figures["cpu_s"]) == {"memsvc", "model_svc", "scheduler_svc"}
            assert len(figures["round_worker_cpu_s"]) == 2
            assert figures["cpu_s"]["model_svc"] > 0
            assert sum(figures["round_worker_cpu_s"]) == pytest.approx(
                figures["cpu_s"]["model_svc"], abs=0.02
            )
        assert cell["hicache"]["memsvc"]["write_policy"]  # memsvc's own, reported
    assert quick["leaked_segments"] == []


def test_both_stacks_replied_alike_and_the_figures_add_up(quick: dict[str, Any]) -> None:
    assert quick["all_outputs_identical"] is True
    for cell in quick["cells"]:
        assert cell["outputs_identical"] is True
        assert cell["agreement"]["hicache_vs_radix"]["replies_differing"] == 0
        for name in ("hicache", "radix"):
            figures = cell[name]
            hits = figures["hit_tokens"]
            assert sum(hits.values()) == figures["cached_tokens"]
            # every prompt token was a hit or computed (more where a retraction recomputed)
            assert figures["prefill_tokens"] >= figures["prompt_tokens"] - figures["cached_tokens"]
        assert cell["radix"]["hit_tokens"]["host"] == cell["radix"]["hit_tokens"]["storage"] == 0
        # Roomy: both trees keep everything. (The quick cell's two chats: the second
        # starts after the first's first token; two others that started together
        # could still batch a shared page beyond the system prompt.)
        if cell["working_set_over_pool"] < 1:
            assert cell["hicache"]["prefill_tokens"] == cell["radix"]["prefill_tokens"]
            assert cell["hicache"]["cached_tokens"] == cell["radix"]["cached_tokens"]


def test_the_control_shares_nothing(quick: dict[str, Any]) -> None:
    unique = [c for c in quick["cells"] if c["workload"] == "unique"]
    assert unique
    for cell in unique:  # the no-reuse control: no tier ever hits, every token is computed
        for name in ("hicache", "radix"):
            assert cell[name]["cached_tokens"] == 0
            assert cell[name]["prefill_tokens"] >= cell[name]["prompt_tokens"] > 0
    for cell in quick["cells"]:  # the same prompts on both stacks
        assert cell["hicache"]["prompt_tokens"] == cell["radix"]["prompt_tokens"]


def test_differing_replies_fail_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench()
    result = {"leaked_segments": [], "all_outputs_identical": False, "cells": []}
    monkeypatch.setattr(bench, "run", lambda args: dict(result))
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exited:
        bench.main(["--quick"])
    assert exited.value.code == 1
    result["all_outputs_identical"], result["leaked_segments"] = True, ["/dev/shm/x"]
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exited:
        bench.main(["--quick"])
    assert exited.value.code == 1


def test_a_second_radix_only_stack_measures_the_noise() -> None:
    bench = load_bench()
    rounds = {"round_ttft_p50_s": [2.0, 2.0, 2.0], "round_wall_s": [10.0, 10.0, 10.0]}
    stack = {"ttft_p50_s": 2.0, "ttft_p99_s": 4.0, "requests_per_s": 1.0, **rounds}
    served = {
        "hicache": {"ttft_p50_s": 1.0, "ttft_p99_s": 4.0, "requests_per_s": 1.5,
                    "round_ttft_p50_s": [1.0, 4.0, 1.0], "round_wall_s": [5.0, 20.0, 8.0]},
        "radix": stack,
        "radix_b": {**stack, "ttft_p50_s": 2.5, "requests_per_s": 0.9},
    }  # fmt: skip
    assert bench.speedups(served) == {
        "ttft_p50_speedup": 2.0,
        "ttft_p99_speedup": 1.0,
        "throughput_ratio": 1.5,
        # round by round, and the median: the slowed round (4.0 s, 20 s) is set aside
        "round_ttft_p50_speedups": [2.0, 0.5, 2.0],
        "round_throughput_ratios": [2.0, 0.5, 1.25],
        "median_round_ttft_p50_speedup": 2.0,
        "median_round_throughput_ratio": 1.25,
        "control_ttft_p50_speedup": 0.8,  # radix-only against itself, as the hierarchy is
        "control_throughput_ratio": 0.9,
        "control_round_ttft_p50_speedups": [1.0, 1.0, 1.0],
        "control_round_throughput_ratios": [1.0, 1.0, 1.0],
        "control_median_round_ttft_p50_speedup": 1.0,
        "control_median_round_throughput_ratio": 1.0,
    }
    del served["radix_b"]
    assert "control_ttft_p50_speedup" not in bench.speedups(served)
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        bench.main(["--stacks", "hicache,radix,radix_c"])  # only the stacks it knows


class FakeClient:
    """Streams one token then the result per request, and logs when each was sent and
    when its first token came out."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    async def info(self) -> dict[str, Any]:
        return {"stats": {}}

    async def stream(self, prompt: list[int], *, rid: str, sampling: dict[str, Any]) -> Any:
        from scheduler_svc.generation import Chunk, GenerateResult

        self.log.append(("sent", rid))
        for _ in range(3):  # let every other task that can run, run
            await asyncio.sleep(0)
        self.log.append(("first", rid))
        yield Chunk(rid, [7], 0)
        yield GenerateResult(rid, [7], None, {"finish_reason": {"type": "length"}})


def serve_one_round(system_len: int) -> list[tuple[str, str]]:
    from types import SimpleNamespace

    workload = SimpleNamespace(
        spec=SimpleNamespace(in_flight=3, system_len=system_len, output_len=1), end_of_turn=[2]
    )
    serving = load_bench("hicache_serve")
    chats = [serving.Chat(f"c{i}", [[10 + i], [20 + i]], [1, 1, 1]) for i in range(4)]
    client = FakeClient()
    asyncio.run(serving.serve_round(client, chats, workload))
    assert all(len(c.turns) == 2 for c in chats)
    return client.log


def test_with_a_shared_prefix_the_first_chat_opens_the_round_alone() -> None:
    # Sent together, the first turns could land in one prefill batch and each compute
    # the shared prefix, or not, by chance: the others wait for the first's first token.
    log = serve_one_round(system_len=8)
    leader_first = log.index(("first", "c0-t0"))
    others = [log.index(("sent", f"c{i}-t0")) for i in range(1, 4)]
    assert log[0] == ("sent", "c0-t0")
    assert all(sent > leader_first for sent in others)


def test_without_a_shared_prefix_the_chats_start_together() -> None:
    log = serve_one_round(system_len=0)
    assert log[:3] == [("sent", f"c{i}-t0") for i in range(3)]  # in_flight of them at once
