"""``kvstack demo``: the real three runs end to end, and its pieces on fake results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.demo import cli as demo
from kvstack.demo import plots as demo_plots
from kvstack.stack.launch import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IDENTICAL = "token-identical to the no-pressure reference"


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The demo's rich table as {first cell: other cells}, header row included."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith(("│", "┃")):
            cells = [c.strip() for c in line.strip("│┃").replace("┃", "│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """One real ``python -m kvstack.demo``; its work folders go under ``tmp``."""
    plots = tmp_path_factory.mktemp("plots") / "out"
    tmp = tmp_path_factory.mktemp("tmp")
    proc = subprocess.run(
        [sys.executable, "-m", "kvstack.demo", "--requests", "4", "--plots-dir", str(plots)],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "120", "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    return proc, plots, tmp


def test_demo_end_to_end(demo_run):
    proc, plots, _ = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"all 5 outputs of normal and PD are {IDENTICAL}" in out
    assert f"written to {plots}" in out
    rows = table_rows(out)
    assert rows["measure"] == ["normal", "PD", "reference"]
    normal, pd, reference = (int(v) for v in rows["retractions (events)"])
    assert normal > 0 and pd > 0 and reference == 0
    assert int(rows["tokens re-prefilled"][0]) > 0  # normal mode recomputes its victims
    offloaded = [int(v.replace(",", "")) for v in rows["bytes offloaded"]]
    assert offloaded[0] == 0 and offloaded[1] > 0  # PD mode offloads them instead
    assert rows["requests"] == ["5", "5", "5"] and rows["aborts"] == ["0", "0", "0"]
    assert len(set(rows["tokens generated"])) == 1


def test_demo_leaves_no_process_or_folder_behind(demo_run):
    _, _, tmp = demo_run
    assert list(tmp.glob("kvstack-demo-*")) == []  # its work folder (sockets, logs) is gone
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        assert str(tmp) not in text, f"a demo process is still running: {text}"


def test_demo_writes_every_plot(demo_run):
    _, plots, _ = demo_run
    for name in demo_plots.FILES:
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


def test_identical_check_fails_when_an_output_differs():
    reference = {"long": [1, 2, 3], "short-0": [4, 5]}
    code, line = demo.check_identical(reference, {"normal": dict(reference), "PD": dict(reference)})
    assert code == 0 and IDENTICAL in line
    code, line = demo.check_identical(
        reference, {"normal": dict(reference), "PD": {"long": [1, 2, 3], "short-0": [4, 6]}}
    )
    assert code == 1 and "PD" in line and "short-0" in line and "normal" not in line
    code, line = demo.check_identical(reference, {"normal": {"long": [1, 2, 3]}})  # one missing
    assert code == 1 and "short-0" in line


def fake_run(name: str, retracts: list[int], **stats: int) -> demo.RunResult:
    samples = [
        demo.Sample(
            t=0.1 * i,
            used=100 + 10 * i,
            evictable=5 * i,
            new_token_ratio=0.2 + 0.1 * i,
            queues={"running": i, "waiting": 3 - i} if name == "normal" else {"prealloc": i},
            retract_events=n,
        )
        for i, n in enumerate(retracts)
    ]
    base = dict.fromkeys(
        ("retract_events", "retracted_reqs", "reprefilled_tokens", "offloaded_tokens"), 0
    )
    return demo.RunResult(
        name=name,
        outputs={"a": [1, 2], "b": [3]},
        finish_types={"a": "length", "b": "abort"},
        latencies=[0.5, 1.5],
        seconds=2.0,
        stats={**base, "loaded_tokens": 0, **stats},
        bytes_per_token=4096,
        capacity=256,
        samples=samples,
    )


def test_summary_and_retract_times_from_fake_runs():
    run = fake_run("PD", [0, 1, 1, 3], retract_events=3, offloaded_tokens=10, loaded_tokens=10)
    s = demo.summarize(run)
    assert s["generated"] == 3 and s["aborts"] == 1 and s["tokens_per_s"] == 1.5
    assert s["offloaded_bytes"] == s["loaded_bytes"] == 40960
    assert s["p50"] == 1.5 and s["p99"] == 1.5
    assert demo_plots.retract_times(run.samples) == pytest.approx([0.1, 0.3, 0.3])


def test_plots_from_fake_runs(tmp_path):
    runs = {
        "normal": fake_run("normal", [0, 1, 2], reprefilled_tokens=30),
        "PD": fake_run("PD", [0, 0, 1], offloaded_tokens=10, loaded_tokens=10),
    }
    cost = {
        "normal": {"reprefilled_tokens": 30, "moved_bytes": 0, "seconds": 0.01},
        "PD": {"reprefilled_tokens": 0, "moved_bytes": 81920, "seconds": 0.0001},
    }
    written = demo_plots.write_all(tmp_path / "plots", runs, cost)
    assert [p.name for p in written] == list(demo_plots.FILES)
    for path in written:
        assert path.read_bytes().startswith(PNG_MAGIC)
