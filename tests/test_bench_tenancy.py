"""bench/tenancy.py end to end at --quick sizes on SmolLM2: what it prints, not how fast.

The cache facts are asserted (no cross-salt request found anything cached, every
same-salt one hit most of its prompt, no cold one found anything); the times are
the benchmark's figures, only checked to be there and positive.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = (
    "cross_salt_cached_tokens",
    "same_salt_cached_tokens",
    "ttft_cold_p50_s",
    "ttft_cross_salt_p50_s",
    "ttft_same_salt_p50_s",
)


@pytest.mark.timeout(300)
def test_quick_run_prints_the_cache_facts_and_medians(smollm2_checkpoint: Path) -> None:
    bench = [sys.executable, str(REPO / "bench" / "tenancy.py"), "--quick"]
    done = subprocess.run(
        [*bench, "--model-path", str(smollm2_checkpoint)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(KEYS) <= set(result), result
    assert result["trials"] == 3
    assert result["cross_salt_cached_tokens"] == 0, result
    assert result["cold_cached_tokens"] == 0, result
    # the whole prompt but its last partial page (16 tokens) and the token after it
    assert result["same_salt_cached_tokens"] >= result["prompt_tokens"] - 2 * 16, result
    assert all(result[k] > 0 for k in KEYS if k.startswith("ttft_")), result
