"""bench/model_step.py end to end on the tiny model at tiny sizes: what it prints, not how fast.

The benchmark's whole code path runs (kvstack's paged worker over a pool and
transformers' forward with a dense cache, prefill and decode); the test checks
the last stdout line's JSON: its shape, and that every ratio is a positive
finite number. Wall-clock figures are the benchmark's business, not a test's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

import kvstack.model.fetch
from model_svc.tiny import DEFAULT_DIR_NAME

BENCH = Path(__file__).resolve().parents[2] / "bench" / "model_step.py"
SMALL = [
    "--threads", "1", "--repeats", "1", "--decode-steps", "2", "--context-len", "20",
    "--prefill-lens", "16,40", "--ratio-prefill-len", "40",
    "--decode-batches", "1,3", "--ratio-batch", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_step() -> ModuleType:
    spec = importlib.util.spec_from_file_location("model_step", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_step"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def run_bench(model_step: ModuleType, argv: list[str], capsys, monkeypatch) -> dict:
    # Process-wide setup is the command's, not the test process's.
    monkeypatch.setattr(model_step, "install_sigterm_cleanup", lambda: None)
    monkeypatch.setattr(model_step, "keep_freed_memory", lambda: None)
    model_step.main(argv)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def assert_positive_finite(value: object) -> None:
    assert isinstance(value, float) and math.isfinite(value) and value > 0, value


def test_prints_ratios_against_transformers(
    model_step: ModuleType, tiny_checkpoint: Path, capsys, monkeypatch
) -> None:
    result = run_bench(
        model_step, ["--model-path", str(tiny_checkpoint), *SMALL], capsys, monkeypatch
    )
    assert result["model"]["path"] == str(tiny_checkpoint)
    assert result["threads"] == 1
    assert result["hf_attn_implementation"]
    assert set(result["prefill"]) == {"16", "40"}
    assert set(result["decode"]) == {"1", "3"}
    for figure in result["prefill"].values():
        for key in ("seconds", "tokens_per_s", "hf_seconds", "hf_tokens_per_s", "ratio_vs_hf"):
            assert_positive_finite(figure[key])
    for figure in result["decode"].values():
        for key in ("ms_per_step", "ms_per_token", "hf_ms_per_step", "ratio_vs_hf"):
            assert_positive_finite(figure[key])
    assert_positive_finite(result["ratio_decode_vs_hf"])
    assert_positive_finite(result["ratio_prefill_vs_hf"])
    assert result["ratio_decode_vs_hf"] == result["decode"]["3"]["ratio_vs_hf"]
    assert result["ratio_prefill_vs_hf"] == result["prefill"]["40"]["ratio_vs_hf"]
    assert result["decode_context_len_max"] == 20 + 2 * 2


def test_without_transformers_the_ratios_are_null(
    model_step: ModuleType, tiny_checkpoint: Path, capsys, monkeypatch
) -> None:
    argv = ["--model-path", str(tiny_checkpoint), "--no-hf", *SMALL]
    result = run_bench(model_step, argv, capsys, monkeypatch)
    assert result["ratio_decode_vs_hf"] is None and result["ratio_prefill_vs_hf"] is None
    assert result["hf_attn_implementation"] is None
    assert_positive_finite(result["decode"]["3"]["ms_per_step"])
    assert result["decode"]["3"]["hf_ms_per_step"] is None


def test_model_names_resolve_as_kvstack_does(
    model_step: ModuleType, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("KVSTACK_HOME", str(tmp_path))
    assert model_step.resolve_model_path("tiny") == tmp_path / DEFAULT_DIR_NAME
    fetched: list[str] = []
    monkeypatch.setattr(
        kvstack.model.fetch, "fetch", lambda name: fetched.append(name) or tmp_path / name
    )
    assert model_step.resolve_model_path("smollm2") == tmp_path / "smollm2"
    assert fetched == ["smollm2"]
    assert model_step.resolve_model_path(str(tmp_path / "x")) == tmp_path / "x"


def test_default_prefill_lengths_and_checked_ratio_figures(model_step: ModuleType) -> None:
    assert model_step.parse_args([]).prefill_lens == model_step.PREFILL_LENS
    assert model_step.parse_args(["--model-path", "smollm2"]).prefill_lens == (512, 2048)
    with pytest.raises(SystemExit):
        model_step.parse_args(["--decode-batches", "1,2"])  # no batch of 16 for the ratio
    with pytest.raises(SystemExit):
        model_step.parse_args(["--prefill-lens", "512"])  # no 2048 for the ratio
