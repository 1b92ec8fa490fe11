"""config.json as transformers 4.x and 5.x write it: every field honoured or refused.

4.x puts ``rope_theta`` / ``rope_scaling`` / ``torch_dtype`` at the top level; 5.x
moves RoPE into ``rope_parameters`` and writes ``dtype``. The same model in
either form must give the same :class:`ModelConfig` and the same rotary
frequencies; whatever would change the math is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from model_svc.config import CONFIG_FILE, GENERATION_CONFIG_FILE, ModelConfig, RopeScaling
from model_svc.errors import CheckpointError
from model_svc.rope import rope_inv_freq

_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "use_cache": True,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
}
# The scaling fields of each supported kind, as both versions spell them.
_SCALING = {
    "default": {},
    "linear": {"factor": 4.0},
    "llama3": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def v4(kind: str = "default", theta: float = 500000.0, **changes: object) -> dict:
    """As transformers 4.x wrote it: no head_dim (derived), rope at the top level."""
    scaling = None if kind == "default" else {"rope_type": kind, **_SCALING[kind]}
    return _COMMON | {
        "torch_dtype": "bfloat16",
        "rope_theta": theta,
        "rope_scaling": scaling,
        "transformers_version": "4.46.3",
        **changes,
    }


def v5(kind: str = "default", theta: float = 500000.0, **changes: object) -> dict:
    """As transformers 5.x writes it: head_dim always, RoPE inside rope_parameters."""
    return _COMMON | {
        "dtype": "bfloat16",
        "head_dim": 16,
        "rope_parameters": {"rope_theta": theta, "rope_type": kind, **_SCALING[kind]},
        "transformers_version": "5.0.0",
        **changes,
    }


def load(tmp_path: Path, data: dict, generation: dict | str | None = None) -> ModelConfig:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / CONFIG_FILE).write_text(json.dumps(data))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (ckpt / GENERATION_CONFIG_FILE).write_text(text)
    return ModelConfig.from_file(ckpt)


def test_rope_parameters_theta_is_read(tmp_path: Path) -> None:
    # 5.x has no top-level rope_theta: it used to fall back to 10000 here.
    data = v5(theta=100000.0)
    assert "rope_theta" not in data
    config = load(tmp_path, data)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None


@pytest.mark.parametrize("kind", sorted(_SCALING))
def test_4x_and_5x_forms_give_the_same_model(tmp_path: Path, kind: str) -> None:
    old = load(tmp_path / "old", v4(kind))
    new = load(tmp_path / "new", v5(kind))
    assert old == new
    assert new.rope_theta == 500000.0 and new.dtype == "bfloat16" and new.head_dim == 16
    assert (new.rope_scaling.kind if new.rope_scaling else "default") == kind
    assert torch.equal(rope_inv_freq(old, torch.float64), rope_inv_freq(new, torch.float64))
    # What the worker writes (the 4.x form) reads back as the same config.
    assert ModelConfig.from_dict(new.to_dict()) == new


def test_both_rope_forms_that_agree_are_accepted(tmp_path: Path) -> None:
    both = v5("llama3") | {"rope_theta": 500000.0, "rope_scaling": v4("llama3")["rope_scaling"]}
    assert load(tmp_path, both) == load(tmp_path, v5("llama3"))
    # The oldest spelling of the kind: "type" instead of "rope_type".
    legacy = v4("linear", rope_scaling={"type": "linear", "factor": 4.0})
    assert load(tmp_path, legacy).rope_scaling == RopeScaling("linear", 4.0)


def test_head_dim_given_or_derived(tmp_path: Path) -> None:
    assert load(tmp_path, v4()).head_dim == 16  # 64 / 4
    wide = load(tmp_path, v5(head_dim=32))  # wider than hidden_size / heads
    assert wide.head_dim == 32 and wide.q_size == 128 and wide.kv_size == 64
    assert rope_inv_freq(wide).shape == (16,)
    assert ModelConfig.from_dict(wide.to_dict()) == wide


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (v4(), "bfloat16"),
        (v4(torch_dtype="float16"), "float16"),
        (v5(dtype="float32"), "float32"),
        (v5(dtype="float16", torch_dtype="float16"), "float16"),
        ({k: v for k, v in v5().items() if k != "dtype"}, "float32"),
        (v5(dtype=None), "float32"),
    ],
)
def test_dtype(tmp_path: Path, data: dict, want: str) -> None:
    config = load(tmp_path, data)
    assert config.dtype == want
    assert ModelConfig.from_dict(config.to_dict()).dtype == want


def test_eos_ids_int_or_list_and_generation_config(tmp_path: Path) -> None:
    assert load(tmp_path, v5()).eos_token_ids == (257,)
    assert load(tmp_path, v5(eos_token_id=[257, 1, 2])).eos_token_ids == (257, 1, 2)
    assert load(tmp_path, v5(eos_token_id=None)).eos_token_ids == ()
    # generation_config.json adds its stop ids (the union, config.json's first).
    config = load(tmp_path, v5(), {"bos_token_id": 256, "eos_token_id": [3, 257, 4]})
    assert config.eos_token_ids == (257, 3, 4) and config.bos_token_id == 256
    assert load(tmp_path, v5(), {"eos_token_id": 5}).eos_token_ids == (257, 5)
    # ...and gives the bos id a config.json leaves out.
    config = load(tmp_path, v5(bos_token_id=None, eos_token_id=None), {"bos_token_id": 7})
    assert config.bos_token_id == 7 and config.eos_token_ids == ()
    # Sampling defaults in it are not this reader's business.
    assert load(tmp_path, v4(), {"temperature": 0.6, "do_sample": True}) == load(tmp_path, v4())
    # The merged ids are what to_dict writes, so the worker's info reads back the same.
    merged = load(tmp_path, v5(), {"eos_token_id": [3, 4]})
    assert ModelConfig.from_dict(merged.to_dict()) == merged
    # from_dict takes the generation config's fields too.
    assert ModelConfig.from_dict(v4(), {"eos_token_id": [9]}).eos_token_ids == (257, 9)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # RoPE
        (v5() | {"rope_theta": 10000.0}, r"rope_theta 10000\.0 .*rope_parameters.*500000\.0"),
        (
            v5("linear") | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            r"rope_scaling .*factor.*2\.0.* disagrees with rope_parameters",
        ),
        (v5("linear") | {"rope_scaling": None}, None),  # 4.x's null: nothing to disagree
        (
            v5(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            r"rope_parameters rope_type 'yarn' is not supported",
        ),
        (
            v5(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "rope_type 'dynamic'",
        ),
        (v5(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope'"),
        (v4(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling type 'dynamic'"),
        (
            v5(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
            "rope_parameters of type 'llama3' lacks 'low_freq_factor'",
        ),
        (v5(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "lacks 'factor'"),
        (
            v5(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
            "one rope_parameters per layer type",
        ),
        (v5(rope_parameters=[1, 2]), "rope_parameters must be an object"),
        (v5(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta must be"),
        (
            v5(
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            ),
            "partial_rotary_factor 0.5",
        ),
        (v4(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
        # dtype
        (v4(torch_dtype="float8_e4m3fn"), "torch_dtype 'float8_e4m3fn' is not supported"),
        (v5(dtype="int8"), "dtype 'int8' is not supported"),
        (v5(dtype="bfloat16", torch_dtype="float16"), "torch_dtype 'float16' and dtype 'bfloat16'"),
        # architecture
        (v5(architectures=["MistralForCausalLM"]), r"architectures \['MistralForCausalLM'\]"),
        (
            v5(architectures=["LlamaForCausalLM", "LlamaForSequenceClassification"]),
            "'LlamaForSequenceClassification'",
        ),
        (v5(architectures="LlamaForCausalLM"), "architectures must be a list"),
        (v5(model_type="qwen2"), "model_type 'qwen2' is not supported"),
        # quantized weights
        (v5(quantization_config={"quant_method": "awq", "bits": 4}), "quantized.*'awq'"),
        (v4(quantization_config={"quant_method": "fp8"}), "quantized.*'fp8'"),
        (v4(quantization_config={"load_in_4bit": True}), "quantized.*unknown"),
        # special ids
        (v5(eos_token_id=[257, 9999]), "9999 is outside the vocabulary"),
        (v5(eos_token_id="</s>"), "eos_token_id must be an int or a list of ints"),
        (v5(eos_token_id=[257, True]), "eos_token_id must be an int or a list of ints"),
    ],
)
def test_refused(tmp_path: Path, data: dict, message: str | None) -> None:
    if message is None:
        load(tmp_path, data)
        return
    with pytest.raises(CheckpointError, match=message) as info:
        load(tmp_path, data)
    assert CONFIG_FILE in str(info.value)


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ({"eos_token_id": [257, 9999]}, "9999 is outside the vocabulary"),
        ({"eos_token_id": "x"}, "eos_token_id must be an int or a list of ints"),
        ({"bos_token_id": 1}, "bos_token_id 1 .*disagrees with config.json's 256"),
        ("{nope", "not a readable JSON file"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_bad_generation_config(tmp_path: Path, generation: dict | str, message: str) -> None:
    with pytest.raises(CheckpointError, match=message) as info:
        load(tmp_path, v5(), generation)
    assert GENERATION_CONFIG_FILE in str(info.value)


def test_config_file_path_reads_generation_config_beside_it(tmp_path: Path) -> None:
    load(tmp_path, v5(), {"eos_token_id": 3})
    assert ModelConfig.from_file(tmp_path / "ckpt" / CONFIG_FILE).eos_token_ids == (257, 3)


def test_tied_embeddings_read_in_both_forms(tmp_path: Path) -> None:
    assert load(tmp_path, v4(tie_word_embeddings=True)).tie_word_embeddings
    assert not load(
        tmp_path, {k: v for k, v in v5().items() if k != "tie_word_embeddings"}
    ).tie_word_embeddings
    with pytest.raises(CheckpointError, match="tie_word_embeddings must be true or false"):
        load(tmp_path, v5(tie_word_embeddings="yes"))


def test_dtype_is_checked_when_built_directly() -> None:
    config = ModelConfig.from_dict(v5())
    with pytest.raises(CheckpointError, match="dtype 'half'"):
        dataclasses.replace(config, dtype="half")


def test_what_transformers_writes_and_computes(tmp_path: Path) -> None:
    """Ground truth (transformers is in the test extra): its 5.x files and its frequencies."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for kind in sorted(_SCALING):
        ours = load(tmp_path / kind, v5(kind))
        hf = transformers.LlamaConfig(
            **{k: v for k, v in v5(kind).items() if k != "transformers_version"}
        )
        saved = tmp_path / f"hf-{kind}"
        hf.save_pretrained(saved)
        transformers.GenerationConfig(bos_token_id=256, eos_token_id=[257, 3]).save_pretrained(
            saved
        )
        from_hf = ModelConfig.from_file(saved)
        assert dataclasses.replace(from_hf, eos_token_ids=(257,)) == ours
        assert from_hf.eos_token_ids == (257, 3)
        want = LlamaRotaryEmbedding(hf).inv_freq
        torch.testing.assert_close(rope_inv_freq(ours), want)
        # transformers reads what the worker writes (the 4.x form) as the same RoPE.
        back = transformers.LlamaConfig.from_dict(ours.to_dict())
        assert back.rope_parameters["rope_theta"] == ours.rope_theta
        assert back.rope_parameters["rope_type"] == kind
        assert str(back.dtype).removeprefix("torch.") == ours.dtype
        torch.testing.assert_close(LlamaRotaryEmbedding(back).inv_freq, want)
