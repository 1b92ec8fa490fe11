"""bench/control_plane.py end to end at --quick sizes: what it prints, not how fast.

Every section runs its whole path (memsvc processes, the in-process twin, the
echo server, the engine); the test reads the last stdout line's JSON and checks
its shape, that every timing is a positive finite number, that the round trips
are counted as integers, and what the set-up must have done: a full pool evicts
on every step and a free one never does. Wall-clock figures are the
benchmark's business, not a test's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def control_plane(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # its sibling modules, as when run as a script
    spec = importlib.util.spec_from_file_location("control_plane", BENCH / "control_plane.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "control_plane", module)
    spec.loader.exec_module(module)
    return module


def run(control_plane: ModuleType, capsys: pytest.CaptureFixture, *argv: str) -> dict:
    control_plane.main(["--quick", *argv])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_memsvc_sections_at_quick_sizes(control_plane: ModuleType, capsys) -> None:
    argv = ("--sections", "evict", "decode", "retract", "admission")
    result = run(control_plane, capsys, *argv)
    assert result["machine"] and result["python"]
    pages, trees, batches = [1, 16], [300, 1000], [1, 16]
    assert [r["page_size"] for r in result["evict"]] == [p for p in pages for _ in trees]
    assert all(positive(r["heap_ms"]) and positive(r["full_walk_ms"]) for r in result["evict"])

    decode = result["decode"]
    assert [(r["page_size"], r["nodes_target"], r["batch"]) for r in decode] == [
        (p, n, b) for p in pages for n in trees for b in batches
    ]
    for row in decode:
        assert row["tree_tokens"] > 0 and row["pool_tokens"] >= 200_000
        for phase in ("free", "full"):
            assert all(positive(row[phase][m]) for m in ("async", "sync", "call", "handler"))
            assert positive(row[phase]["echo"])
        assert row["free"]["evicted_per_step"] == 0  # a free pool never evicts
        if row["batch"] >= row["page_size"]:  # some row opens a page on every step ...
            assert row["full"]["evicted_per_step"] > 0  # ... and a full pool evicts for it
        assert all(positive(row[f"full_over_free_{m}"]) for m in ("async", "sync", "handler"))
    # The headline figures are for the sizes only.
    assert "decode_full_over_free_256_100k" not in result

    assert [r["page_size"] for r in result["retract"]] == pages
    for row in result["retract"]:
        assert (row["victims"], row["batch"]) == (32, 256)
        assert all(positive(row[m]) for m in ("async", "sync", "call", "handler", "echo"))
    assert positive(result["retract_32_of_256_async_us"])

    trips = result["admission_64_round_trips"]
    assert isinstance(trips, int) and trips >= 1
    for row in result["admission"]:
        assert row["prompts"] == 64
        assert row["round_trips"] == row["round_trips_inproc"] == sum(row["ops"].values())
        assert positive(row["process_ms"]) and positive(row["inproc_ms"])
    assert trips == max(r["round_trips"] for r in result["admission"])


@pytest.mark.slow
def test_overlap_section_with_the_tiny_model(control_plane: ModuleType, capsys) -> None:
    result = run(control_plane, capsys, "--sections", "overlap", "--page-sizes", "1")
    assert [(r["page_size"], r["batch"]) for r in result["overlap"]] == [(1, 4)]
    assert result["overlap_batch"] == 4
    for key in ("exposed_share_overlap_on", "exposed_share_overlap_off"):
        assert 0 < result[key] < 1
    row = result["overlap"][0]
    assert positive(row["step_ms_on"]) and positive(row["step_ms_off"])
    for mode in ("on", "off"):  # memsvc's share is part of the exposed share
        assert 0 <= row[f"exposed_memsvc_{mode}"] <= row[f"exposed_{mode}"]
    assert row["exposed_memsvc_off"] > 0  # without the overlap, decode_step is exposed
    # The schedule really switched: steps reserved their next one only with it on.
    assert result["overlap_schedule_in_engine"]
    assert row["reserved_ahead_on"] > 0 and row["reserved_ahead_off"] == 0
