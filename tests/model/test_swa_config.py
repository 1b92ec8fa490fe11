"""Sliding-window settings in config.json: each form honoured as transformers reads it, or
refused by name.

The oracle for every accepted form is transformers' own config class (the
installed version): the layers it windows and the window it gives them are the
ones :class:`ModelConfig` reports.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import transformers

from model_svc.config import CONFIG_FILE, ModelConfig
from model_svc.errors import CheckpointError

F, S = "full_attention", "sliding_attention"
_BASE = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


def mistral(**changes: object) -> dict:
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral"} | _BASE | changes


def ministral(**changes: object) -> dict:
    return {"architectures": ["MinistralForCausalLM"], "model_type": "ministral"} | _BASE | changes


def llama(**changes: object) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | _BASE | changes


def hf_windows(data: dict) -> list[int | None]:
    """The window transformers' model gives each layer for this config.json (None: full)."""
    config = transformers.AutoConfig.for_model(**data)
    layers = config.num_hidden_layers
    if data["model_type"] == "mistral":  # MistralAttention: the one sliding_window, every layer
        return [config.sliding_window] * layers
    if data["model_type"] == "ministral":  # MinistralAttention: by layer_types
        return [config.sliding_window if t == S else None for t in config.layer_types]
    return [None] * layers  # LlamaAttention has no window


def windows(config: ModelConfig) -> list[int | None]:
    return [config.layer_window(i) for i in range(config.num_hidden_layers)]


@pytest.mark.parametrize(
    ("data", "want"),
    [
        # Mistral: one window for every layer, or none
        (mistral(sliding_window=32), [32] * 4),
        (mistral(sliding_window=None), [None] * 4),
        (mistral(), [4096] * 4),  # MistralConfig's default window when the file omits it
        (mistral(sliding_window=32, layer_types=[S] * 4), [32] * 4),  # what Mistral does anyway
        # Ministral: per layer
        (ministral(sliding_window=32, layer_types=[S, S, F, S]), [32, 32, None, 32]),
        (ministral(sliding_window=32), [32] * 4),  # default: every layer slides
        (ministral(sliding_window=None), [None] * 4),
        (ministral(), [4096] * 4),
        (ministral(sliding_window=32, layer_types=[F] * 4), [None] * 4),
        (ministral(sliding_window=32, layer_types=[S, "attention", S, F]), [32, None, 32, None]),
        (ministral(sliding_window=None, layer_types=[F] * 4), [None] * 4),
        # Llama: none; Qwen2's fields without use_sliding_window window nothing in Qwen2 either
        (llama(), [None] * 4),
        (llama(sliding_window=None, layer_types=[F] * 4), [None] * 4),
        (mistral(sliding_window=32, use_sliding_window=False, max_window_layers=2), [32] * 4),
    ],
)
def test_honoured_as_transformers_reads_it(data: dict, want: list[int | None]) -> None:
    config = ModelConfig.from_dict(data)
    assert windows(config) == want == hf_windows(data)
    assert config.sliding_layer_ids == tuple(i for i, w in enumerate(want) if w is not None)
    back = ModelConfig.from_dict(config.to_dict())
    assert back == config
    assert hf_windows(config.to_dict()) == want  # transformers reads what we write the same


def test_architecture_and_defaults() -> None:
    config = ModelConfig.from_dict(mistral(sliding_window=32))
    assert config.architecture == "MistralForCausalLM"
    assert config.to_dict()["model_type"] == "mistral"
    data = ministral(sliding_window=8, layer_types=[S, F, S, F])
    del data["max_position_embeddings"], data["architectures"]
    config = ModelConfig.from_dict(data)  # model_type alone names the class
    assert config.architecture == "MinistralForCausalLM"
    hf = transformers.AutoConfig.for_model(**data)
    assert config.max_position_embeddings == hf.max_position_embeddings == 131072
    assert config.layer_types == (S, F, S, F) and config.sliding_window == 8
    # A model without a sliding layer keeps no window: the same config as Llama's math.
    plain = ModelConfig.from_dict(ministral(sliding_window=32, layer_types=[F] * 4))
    assert plain.sliding_window is None and plain.layer_types == ()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (llama(sliding_window=32), "sliding_window 32 is not supported for LlamaForCausalLM"),
        (
            llama(layer_types=[S, F, F, F]),
            "layer_types with sliding_attention is not supported for LlamaForCausalLM",
        ),
        (
            mistral(sliding_window=32, layer_types=[S, F, S, F]),
            "layer_types .* is not supported for MistralForCausalLM",
        ),
        (
            mistral(sliding_window=None, layer_types=[S] * 4),
            "layer_types .* is not supported for MistralForCausalLM",
        ),
        (
            ministral(sliding_window=None, layer_types=[S, F, F, F]),
            "sliding_attention layers but sliding_window is null",
        ),
        (ministral(sliding_window=32, layer_types=[S, F]), "layer_types has 2 entries for .* 4"),
        (ministral(layer_types=[S, "chunked_attention", S, F]), r"\['chunked_attention'\]"),
        (ministral(layer_types="sliding_attention"), "layer_types must be a list"),
        (ministral(sliding_window=0), "sliding_window must be a positive int or null, got 0"),
        (mistral(sliding_window="32"), "sliding_window must be a positive int"),
        (mistral(sliding_window=True), "sliding_window must be a positive int"),
        (
            mistral(use_sliding_window=True, sliding_window=32, max_window_layers=2),
            "use_sliding_window .*max_window_layers 2.* is Qwen2's form",
        ),
        (
            llama(use_sliding_window=True),
            "use_sliding_window .* not supported for LlamaForCausalLM",
        ),
        (
            llama(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
            r"architectures \['Qwen2ForCausalLM'\] are not supported",
        ),
        (llama(model_type="qwen2", architectures=None), "model_type 'qwen2' is not supported"),
        (
            mistral(model_type="ministral"),
            "model_type 'ministral' is not supported with architectures",
        ),
        (ministral(attention_bias=True), "attention_bias=true"),
    ],
)
def test_refused_by_name(tmp_path: Path, data: dict, message: str) -> None:
    data = {
        key: value for key, value in data.items() if value is not None or key != "architectures"
    }
    (tmp_path / CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": (S, F), "sliding_window": 4}, "layer_types has 2 entries"),
        ({"layer_types": (S, F, F, F), "sliding_window": None}, "sliding_window must be"),
        ({"layer_types": (F,) * 4, "sliding_window": 4}, "kept only for a model with a sliding"),
        ({"layer_types": (S,) * 4, "sliding_window": 4}, "LlamaForCausalLM has no sliding"),
        (
            {
                "architecture": "MistralForCausalLM",
                "layer_types": (S, F, F, F),
                "sliding_window": 4,
            },
            "MistralForCausalLM windows every layer or none",
        ),
        ({"architecture": "Qwen2ForCausalLM"}, "architecture 'Qwen2ForCausalLM'"),
    ],
)
def test_model_config_checks_its_window(fields: dict, message: str) -> None:
    base = ModelConfig.from_dict(llama())
    with pytest.raises(CheckpointError, match=message):
        dataclasses.replace(base, **fields)
