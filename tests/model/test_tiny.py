"""The tiny checkpoint: deterministic, varied generations, made once where it is the default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import model_svc.tiny as tiny
from model_svc.checkpoint import WEIGHTS_FILE
from model_svc.config import CONFIG_FILE
from model_svc.model import LlamaModel
from model_svc.reference import generate_dense


def test_greedy_generations_are_varied(tiny_model) -> None:
    outputs = [generate_dense(tiny_model, [tiny.BOS_ID, *p], 32) for p in (b"a", b"Hello", b"42")]
    for output in outputs:
        assert len(set(output)) >= 8, output  # not one token, not a short loop
    assert len({tuple(output) for output in outputs}) == len(outputs)


def test_cli_writes_the_same_checkpoint(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    tiny.main([str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (tmp_path / "out" / name).read_bytes() == (tiny_checkpoint / name).read_bytes()
    tiny.main([str(tmp_path / "seeded"), "--seed", "1"])
    other = LlamaModel.from_checkpoint(tmp_path / "seeded").model.embed_tokens.weight
    assert not torch.equal(
        other, LlamaModel.from_checkpoint(tiny_checkpoint).model.embed_tokens.weight
    )


def test_default_checkpoint_is_made_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTACK_HOME", str(tmp_path / "home"))
    path = tiny.default_checkpoint()
    assert path == tmp_path / "home" / "tiny-llama"
    stamp = (path / WEIGHTS_FILE).stat().st_mtime_ns
    assert tiny.default_checkpoint() == path
    assert (path / WEIGHTS_FILE).stat().st_mtime_ns == stamp
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-llama"]  # no staging left
    LlamaModel.from_checkpoint(path)


def test_default_checkpoint_race_keeps_the_winner(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTACK_HOME", str(tmp_path))
    write = tiny.write_tiny_checkpoint

    def write_while_another_process_wins(out_dir: Path, seed: int = 0) -> Path:
        write(tmp_path / "tiny-llama", seed)  # the other process renames first
        return write(out_dir, seed)

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", write_while_another_process_wins)
    assert tiny.default_checkpoint() == tmp_path / "tiny-llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]


def test_default_checkpoint_refuses_a_broken_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSTACK_HOME", str(tmp_path))
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "junk").write_text("x")
    with pytest.raises(OSError):
        tiny.default_checkpoint()
