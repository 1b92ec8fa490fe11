"""bench/kv_outlives.py's skewed-load part end to end at --quick sizes: what it prints.

Two PD stacks (a prefill node, a hot decode node the router sends everything to,
a cold one) serve the same greedy prompts, without and with the hot node moving
its retracted requests to the cold one. The bench checks every pool idle
before it stops a stack. The test reads the last stdout line's JSON: the
figures are there, the hot node retracted in both runs, moved what it
retracted in the second and the tokens are the same. Latency is the
benchmark's figure, not a test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_skew_run_prints_the_comparison() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kv_outlives.py"), "--quick", "--parts", "skew"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["skew_outputs_identical"] is True, report["skew_errors"]
    for run in ("static", "rebalanced"):
        for key in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "wall_s"):
            assert report[f"skew_{run}_{key}"] > 0, key
        assert report[f"skew_{run}_retracted_reqs"] > 0, f"{run}: the hot node never retracted"
    assert 0 < report["skew_rebalanced_migrated_reqs"] <= report["skew_rebalanced_retracted_reqs"]
    assert report["skew_latency_p50_speedup"] > 0
