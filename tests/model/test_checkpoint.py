"""Checkpoints: the tiny one loads through the HF-layout loader; broken ones fail clearly."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_svc.checkpoint import WEIGHTS_FILE, WEIGHTS_INDEX, load_state_dict
from model_svc.config import CONFIG_FILE, ModelConfig
from model_svc.errors import CheckpointError
from model_svc.model import LlamaModel
from model_svc.reference import dense_logits
from model_svc.tiny import tiny_config, tiny_state_dict, write_checkpoint

PROMPT = [256, *b"checkpoint"]
# A smaller model than the tiny one keeps the many broken copies cheap to write.
SMALL = tiny_config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16)
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def small_ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "small", SMALL, tiny_state_dict(SMALL, seed=5))


def edit_config(ckpt: Path, **changes: object) -> None:
    data = json.loads((ckpt / CONFIG_FILE).read_text())
    data.update(changes)
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))


def rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, ckpt / WEIGHTS_FILE)


def test_tiny_checkpoint_loads_through_the_hf_loader(tiny_checkpoint: Path, tiny_model) -> None:
    config = ModelConfig.from_file(tiny_checkpoint)
    assert config == tiny_config()
    assert tiny_model.config == config and tiny_model.dtype == torch.float32
    expected = tiny_state_dict(config)
    assert set(tiny_model.state_dict()) == set(expected)
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    bf16 = LlamaModel.from_checkpoint(tiny_checkpoint, dtype=torch.bfloat16)
    assert (
        bf16.dtype == torch.bfloat16 and bf16.model.layers[0].mlp.up_proj.weight.dtype == bf16.dtype
    )


def test_sharded_checkpoint_matches_single_file(small_ckpt: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(small_ckpt / CONFIG_FILE, sharded / CONFIG_FILE)
    tensors = load_file(small_ckpt / WEIGHTS_FILE)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, sharded / file)
        weight_map |= dict.fromkeys(shard_names, file)
    (sharded / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = LlamaModel.from_checkpoint(small_ckpt), LlamaModel.from_checkpoint(sharded)
    assert torch.equal(dense_logits(a, PROMPT), dense_logits(b, PROMPT))

    # The index names a shard that is gone; or sends a tensor to a shard without it.
    weight_map[Q_PROJ] = "model-00003-of-00002.safetensors"
    (sharded / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model-00003-of-00002\.safetensors"):
        LlamaModel.from_checkpoint(sharded)
    weight_map[Q_PROJ] = next(f for f, n in shards.items() if Q_PROJ not in n)
    (sharded / WEIGHTS_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"lacks tensor {Q_PROJ}"):
        LlamaModel.from_checkpoint(sharded)


def test_tied_embeddings(tmp_path: Path) -> None:
    config = dataclasses.replace(SMALL, tie_word_embeddings=True)
    state = tiny_state_dict(config, seed=5)
    assert "lm_head.weight" not in state
    model = LlamaModel.from_checkpoint(write_checkpoint(tmp_path / "tied", config, state))
    assert model.lm_head is None
    hidden = torch.randn(2, config.hidden_size)
    want = model.model.norm(hidden) @ state["model.embed_tokens.weight"].T
    torch.testing.assert_close(model.logits(hidden), want)
    # A tied checkpoint that still ships lm_head.weight loads too (HF ignores it).
    state["lm_head.weight"] = torch.zeros(config.vocab_size, config.hidden_size)
    again = LlamaModel.from_checkpoint(write_checkpoint(tmp_path / "tied2", config, state))
    assert torch.equal(dense_logits(again, PROMPT), dense_logits(model, PROMPT))


def test_missing_tensor(small_ckpt: Path) -> None:
    rewrite_weights(small_ckpt, lambda t: t.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match=f"missing tensor.*{Q_PROJ}"):
        LlamaModel.from_checkpoint(small_ckpt)


def test_wrong_shape(small_ckpt: Path) -> None:
    rewrite_weights(small_ckpt, lambda t: t.update({Q_PROJ: torch.zeros(64, 63)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {Q_PROJ} has shape"):
        LlamaModel.from_checkpoint(small_ckpt)


def test_unexpected_tensor(small_ckpt: Path) -> None:
    rewrite_weights(
        small_ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*q_proj\.bias"):
        LlamaModel.from_checkpoint(small_ckpt)


def test_non_finite_or_integer_tensor(small_ckpt: Path) -> None:
    rewrite_weights(small_ckpt, lambda t: t["model.norm.weight"].__setitem__(3, float("nan")))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight holds NaN"):
        LlamaModel.from_checkpoint(small_ckpt)
    rewrite_weights(
        small_ckpt, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    )
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is torch\.int32"):
        LlamaModel.from_checkpoint(small_ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.999, 4])
def test_truncated_or_garbage_safetensors(small_ckpt: Path, keep: float) -> None:
    data = (small_ckpt / WEIGHTS_FILE).read_bytes()
    cut = data[: int(keep)] if keep >= 1 else data[: int(len(data) * keep)]
    (small_ckpt / WEIGHTS_FILE).write_bytes(cut)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        LlamaModel.from_checkpoint(small_ckpt)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "hidden_size must be a positive int"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"rms_norm_eps": "small"}, "rms_norm_eps must be a positive number"),
        ({"eos_token_id": 9999}, "outside the vocabulary"),
        ({"num_hidden_layers": 3}, "missing tensor.*model.layers.2"),
        ({"intermediate_size": 97}, "has shape"),
    ],
)
def test_bad_config(small_ckpt: Path, changes: dict, message: str) -> None:
    edit_config(small_ckpt, **changes)
    with pytest.raises(CheckpointError, match=message):
        LlamaModel.from_checkpoint(small_ckpt)


def test_unreadable_config_and_missing_files(small_ckpt: Path, tmp_path: Path) -> None:
    data = json.loads((small_ckpt / CONFIG_FILE).read_text())
    del data["vocab_size"]
    (small_ckpt / CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"config\.json: config lacks vocab_size"):
        LlamaModel.from_checkpoint(small_ckpt)
    (small_ckpt / CONFIG_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not a readable JSON file"):
        LlamaModel.from_checkpoint(small_ckpt)
    (small_ckpt / CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: no such file"):
        LlamaModel.from_checkpoint(small_ckpt)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_state_dict(tmp_path / "nowhere", SMALL)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weight files"):
        load_state_dict(tmp_path / "empty", SMALL)
