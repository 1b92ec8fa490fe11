"""bench/zero_freed_kv.py at small sizes: what it prints, not how fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "2", "--pages", "32", "--requests", "40", "--system-len", "32",
         "--user-len", "32", "--decode", "8", "--repeat", "1"]  # fmt: skip


def run(*extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "zero_freed_kv.py"), *SMALL, *extra],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_bench_prints_the_cost_and_zeroes_salted_pages_alone() -> None:
    out = run()
    assert {"seconds_off", "seconds_on", "ratio", "zeroed_pages", "zeroing_share"} <= set(out)
    assert (
        out["zeroed_pages"] > 0 and out["zeroed_bytes"] == out["zeroed_pages"] * out["page_bytes"]
    )
    assert run("--salted", "0")["zeroed_pages"] == 0
