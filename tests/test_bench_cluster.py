"""bench/cluster.py end to end at --quick sizes (the tiny model): what it prints, not how fast.

The cache facts are asserted: without the shared tier no later turn found anything in
storage; with it, the later turns (each on the other node) found pages the other
node wrote; every setup's replies equal the single node's. The times are only
checked to be there and positive. Starts four ``kvstack serve`` nodes and a
``mooncake_master`` (the cluster extra), all stopped by the bench.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mooncake_master import require_mooncake

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(420)
def test_quick_run_prints_the_speedup_and_identity() -> None:
    require_mooncake()
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cluster.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outputs_identical"] is True
    assert result["shared_tier_ttft_speedup"] > 0
    setups = result["setups"]
    assert set(setups) == {"single", "rr_local", "rr_shared"}
    assert setups["rr_local"]["later_storage_hit_tokens"] == 0
    assert setups["rr_shared"]["later_storage_hit_tokens"] > 0
    # the shared tier gives the other node back what it lost without it
    assert (
        setups["rr_shared"]["later_prefix_hit_rate"] > setups["rr_local"]["later_prefix_hit_rate"]
    )
    for figures in setups.values():
        assert figures["later_ttft_p50_s"] > 0 and figures["output_tokens_per_s"] > 0
