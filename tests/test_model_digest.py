"""The model digest (issue 30, item 2): computed once per checkpoint, cached by path, size and
mtime, passed to memsvc by the launcher; memsvc refuses a kept storage tier without it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import kvstack.model.digest as digest_mod
from kvstack.model.digest import cache_path, model_digest
from kvstack.stack.model_pool import given_flags, pool_layout_args
from memsvc.config import MemsvcConfig
from memsvc.settings import from_args, parse_args

CONFIG = (
    '{"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 32, '
    '"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}'
)


def checkpoint(tmp_path, weights: bytes = b"w" * 1000):
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(CONFIG)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_digest_is_the_sha256_of_config_and_weights_and_is_cached(tmp_path, monkeypatch):
    folder = checkpoint(tmp_path)
    home = tmp_path / "home"
    want = hashlib.sha256(b"kvstack-model-digest/1\0")
    for name in ("config.json", "model.safetensors"):  # name order; no tokenizer
        data = (folder / name).read_bytes()
        want.update(f"{name}\0{len(data)}\0".encode() + data)
    first = model_digest(folder, home=home)
    assert first == want.hexdigest()
    assert cache_path(folder, home).is_file()
    calls = []
    real = digest_mod.compute_digest
    monkeypatch.setattr(digest_mod, "compute_digest", lambda files: calls.append(1) or real(files))
    assert model_digest(folder, home=home) == first and calls == []  # from the cache
    (folder / "tokenizer.json").write_text('{"changed": 1}')
    assert model_digest(folder, home=home) == first and calls == []  # not part of it
    (folder / "model.safetensors").write_bytes(b"v" * 1000)  # same size, new bytes and mtime
    os.utime(folder / "model.safetensors", ns=(1, 1))
    second = model_digest(folder, home=home)
    assert second != first and calls == [1]
    (folder / "config.json").write_text(CONFIG.replace("2,", "3,", 1))
    assert model_digest(folder, home=home) not in (first, second)


def test_the_launcher_passes_the_digest_to_memsvc(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTACK_HOME", str(tmp_path / "home"))
    folder = checkpoint(tmp_path)
    args = pool_layout_args(folder)
    assert given_flags(args)["--model-digest"] == model_digest(folder)
    assert pool_layout_args(folder, args) == args
    mine = ["--model-digest", "c" * 64]
    assert given_flags(pool_layout_args(folder, mine))["--model-digest"] == "c" * 64


def memsvc_config(argv: list[str]) -> MemsvcConfig:
    import memsvc.__main__ as memsvc_main

    base = ["--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "4"]
    return from_args(MemsvcConfig, parse_args(memsvc_main.build_parser(), base + argv))


def test_memsvc_refuses_a_kept_tier_without_a_model_digest(tmp_path):
    keep = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-dir", str(tmp_path), "--hicache-storage-keep"]  # fmt: skip
    with pytest.raises(ValueError, match="--hicache-storage-keep needs --model-digest"):
        memsvc_config(keep)
    with pytest.raises(ValueError, match="not a sha256"):
        memsvc_config(["--model-digest", "xyz"])
    config = memsvc_config([*keep, "--model-digest", "d" * 64])
    assert config.identity.model_digest == "d" * 64 and config.hicache.storage_keep
    assert memsvc_config([]).identity.model_digest is None
    base = ["--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "4"]
    out = subprocess.run(
        [sys.executable, "-m", "memsvc", *base, *keep], capture_output=True, timeout=60
    )
    assert out.returncode == 2
    assert b"--hicache-storage-keep needs --model-digest" in out.stderr
