"""bench/swa.py end to end at --quick sizes: what it prints, not how fast.

One run serves the same random hybrid checkpoint (5 of 6 layers windowed) on two
real stacks with the same --num-pages: the launcher's two pools, and one pool for
every layer (--disable-hybrid-swa-memory's memsvc flags). The bench checks both
pools idle before it stops each stack. The test reads the last stdout line's
JSON: its shape, that greedy outputs are identical, that both layouts take the
same KV bytes (the hybrid's split rounds down to whole pages), and that the
hybrid layout held more concurrent context. Throughput is the benchmark's
figure, not a test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STACK_KEYS = (
    "peak_context_tokens",
    "mean_context_tokens",
    "peak_running_reqs",
    "retracted_reqs",
    "reprefilled_tokens",
    "output_tokens_per_s",
    "wall_s",
    "pool",
)


def test_quick_run_prints_the_comparison() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "swa.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["outputs_identical"] is True
    assert report["leaked_segments"] == []
    hybrid, full = report["hybrid"], report["all_full"]
    for figures in (hybrid, full):
        assert set(STACK_KEYS) <= set(figures)
        assert figures["samples"] > 0 and figures["peak_running_reqs"] >= 1
    # the same bytes: the hybrid's two pools round down to whole pages of each
    assert 0.95 * full["pool"]["kv_bytes"] <= hybrid["pool"]["kv_bytes"] <= full["pool"]["kv_bytes"]
    assert full["pool"]["swa_tokens"] == 0 and hybrid["pool"]["swa_tokens"] > 0
    assert hybrid["pool"]["full_tokens"] > 2 * full["pool"]["full_tokens"]
    # the all-full pool holds about three contexts; the hybrid's full pool about eight
    workload = report["workload"]
    context = workload["prompt_len"] + workload["max_new_tokens"]
    assert full["peak_context_tokens"] <= full["pool"]["full_tokens"]
    assert hybrid["peak_context_tokens"] > full["pool"]["full_tokens"] + context // 2
    assert report["concurrency_ratio"] == round(
        hybrid["peak_context_tokens"] / full["peak_context_tokens"], 2
    )
    assert report["concurrency_ratio"] > 1.2
