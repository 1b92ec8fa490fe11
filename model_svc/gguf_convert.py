"""Convert a llama-architecture GGUF file into a Hugging Face-layout checkpoint folder.

``python -m model_svc.gguf_convert GGUF OUT_DIR`` (or :func:`convert_gguf`) writes::

    config.json              LlamaConfig fields, from the GGUF's ``llama.*`` metadata
    model.safetensors        float32, HF tensor names (every tensor dequantized)
    tokenizer.json           a byte-level BPE ``tokenizers`` file from ``tokenizer.ggml.*``
    tokenizer_config.json    special tokens and ``chat_template``
    generation_config.json   bos / eos / pad ids
    conversion.json          where it came from (the GGUF's name, size and format)

The folder is written into a temporary sibling and renamed into place, so a
crash never leaves half a checkpoint behind.

Two layout differences between GGUF and HF are undone here:

* GGUF lists a tensor's dimensions innermost first (``ne``); the numpy / HF
  shape is that list reversed.
* llama.cpp stores q/k projection rows in the interleaved RoPE order (dims
  ``2i`` and ``2i + 1`` of a head pair up); HF, and :mod:`model_svc.model`,
  pair dim ``i`` with ``i + head_dim / 2``. Within each head the rows are
  therefore de-interleaved: row ``2i + j`` of the GGUF head becomes row
  ``j * head_dim / 2 + i``.

Only what the Llama decoder of :mod:`model_svc.model` computes is accepted: an
unknown tensor, a partial rotary dimension or a RoPE scaling it does not
implement is refused with a :class:`GGUFConvertError`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_svc.checkpoint import WEIGHTS_FILE, expected_shapes
from model_svc.config import CONFIG_FILE, GENERATION_CONFIG_FILE, ModelConfig, RopeScaling
from model_svc.errors import CheckpointError
from model_svc.tiny import write_checkpoint
from model_svc.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

CONVERSION_FILE = "conversion.json"
# Every file of a converted folder; CONVERSION_FILE is the one that marks it as ours.
CONVERTED_FILES = (
    CONFIG_FILE,
    WEIGHTS_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    CONVERSION_FILE,
)
CONVERTER_VERSION = 1

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> does the pre-tokenizer split digits one by one before the
# GPT-2 byte-level regex (the StarCoder family, which SmolLM uses).
_PRE_TOKENIZERS = {
    "gpt-2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


class GGUFConvertError(CheckpointError):
    """A GGUF file that cannot be converted: unreadable, not llama, or using a feature
    this worker does not implement. The message names the file and the field or tensor."""

    code = "bad_gguf"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a llama GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ``None`` for an unknown one."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
    return None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, interleaved pairs back to two halves.

    ``weight`` is ``[num_heads * head_dim, in]``; GGUF row ``h * head_dim + 2i + j``
    becomes HF row ``h * head_dim + j * head_dim / 2 + i``.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


# -- reading the GGUF --------------------------------------------------------------


@dataclass
class _Gguf:
    """The parts of a GGUF file the conversion needs."""

    path: Path
    reader: Any  # gguf.GGUFReader

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return _field_value(field)
        except Exception as exc:  # numpy and decoding errors of a malformed field
            raise GGUFConvertError(f"{self.path}: metadata {key} is unreadable ({exc})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFConvertError(f"{self.path}: metadata lacks {key}")
        return value

    def scalar(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GGUFConvertError(f"{self.path}: metadata {key} is {value!r}, not one number")
        if kind is int and value != int(value):
            raise GGUFConvertError(f"{self.path}: metadata {key} is {value!r}, not an integer")
        if kind is float:
            # GGUF floats are float32: 1e-5 is read as 9.99999974e-06. Keep the shortest
            # decimal that is the same float32, as the source config most likely said.
            return float(str(np.float32(value)))
        return kind(value)


def _field_value(field: Any) -> Any:
    """A metadata field as Python values (``ReaderField.contents()`` is newer than gguf 0.14).

    The reader keeps each scalar, string or array element as one numpy part;
    ``field.data`` indexes the parts that hold the value(s).
    """
    from gguf import GGUFValueType

    def one(part: np.ndarray, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == GGUFValueType.BOOL:
            return bool(part[0])
        if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return float(part[0])
        return int(part[0])

    kinds = list(field.types)
    if kinds[0] != GGUFValueType.ARRAY:
        return one(field.parts[field.data[0]], kinds[0])
    if len(kinds) == 1:  # an empty array: the element type is only kept with an element
        return []
    if len(kinds) != 2:
        raise ValueError("nested arrays are not supported")
    return [one(field.parts[index], kinds[1]) for index in field.data]


def _open(path: Path) -> _Gguf:
    try:
        import gguf
    except ImportError:
        raise GGUFConvertError(
            f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)"
        ) from None
    if not path.is_file():
        raise GGUFConvertError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # gguf raises ValueError, struct errors, ... on a bad file
        raise GGUFConvertError(f"{path}: not a readable GGUF file ({exc})") from None
    return _Gguf(path, reader)


def _model_config(src: _Gguf, tensor_names: set[str]) -> ModelConfig:
    arch = src.require("general.architecture")
    if arch != "llama":
        raise GGUFConvertError(f"{src.path}: architecture {arch!r} is not supported (only 'llama')")
    hidden = src.scalar("llama.embedding_length", int)
    heads = src.scalar("llama.attention.head_count", int)
    kv_heads = src.scalar("llama.attention.head_count_kv", int, heads)
    if heads < 1 or hidden % heads:
        raise GGUFConvertError(f"{src.path}: embedding_length {hidden} is not {heads} heads")
    head_dim = src.scalar("llama.attention.key_length", int, hidden // heads)
    value_dim = src.scalar("llama.attention.value_length", int, head_dim)
    rope_dim = src.scalar("llama.rope.dimension_count", int, head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise GGUFConvertError(
            f"{src.path}: key/value/rotary dims {head_dim}/{value_dim}/{rope_dim} differ "
            "(only full rotary attention with equal key and value dims is supported)"
        )
    tokens = src.require("tokenizer.ggml.tokens")
    vocab = src.scalar("llama.vocab_size", int, len(tokens))
    # End of sequence, then llama.cpp's end of turn and end of message: each stops a reply.
    stops = (src.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom"))
    eos_ids = tuple(dict.fromkeys(int(i) for i in stops if i is not None))
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=src.scalar("llama.feed_forward_length", int),
            num_hidden_layers=src.scalar("llama.block_count", int),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=src.scalar("llama.attention.layer_norm_rms_epsilon", float),
            rope_theta=src.scalar("llama.rope.freq_base", float, 10000.0),
            max_position_embeddings=src.scalar("llama.context_length", int, 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=src.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=src.get("tokenizer.ggml.padding_token_id"),
            rope_scaling=_rope_scaling(src, tensor_names),
        )
    except CheckpointError as exc:
        raise GGUFConvertError(f"{src.path}: {exc}") from None


def _rope_scaling(src: _Gguf, tensor_names: set[str]) -> RopeScaling | None:
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1's frequency factors, baked into a tensor; not recovered here.
        raise GGUFConvertError(f"{src.path}: rope_freqs.weight (llama3 RoPE) is not supported")
    kind = src.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", src.scalar("llama.rope.scaling.factor", float))
    raise GGUFConvertError(f"{src.path}: rope scaling {kind!r} is not supported")


def _state_dict(src: _Gguf, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    expected = expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    for tensor in src.reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None or name not in expected:
            raise GGUFConvertError(f"{src.path}: unexpected tensor {tensor.name}")
        if name in state:
            raise GGUFConvertError(f"{src.path}: tensor {tensor.name} appears twice")
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if shape != expected[name]:
            raise GGUFConvertError(
                f"{src.path}: tensor {tensor.name} has shape {list(shape)} (ne reversed), "
                f"the metadata needs {list(expected[name])}"
            )
        try:
            weight = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFConvertError(
                f"{src.path}: tensor {tensor.name} of type {tensor.tensor_type.name} cannot "
                f"be dequantized ({exc})"
            ) from None
        weight = np.asarray(weight, dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        if not np.isfinite(weight).all():
            raise GGUFConvertError(f"{src.path}: tensor {tensor.name} holds NaN or inf")
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        state[name] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise GGUFConvertError(f"{src.path}: lacks tensor(s) {', '.join(missing[:6])}")
    return state


# -- the tokenizer -----------------------------------------------------------------


@dataclass(frozen=True)
class _Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[tuple[str, str]]
    digits_apart: bool

    def token(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        if not 0 <= token_id < len(self.tokens):
            raise GGUFConvertError(f"special token id {token_id} is not in the token list")
        return self.tokens[token_id]


def _vocab(src: _Gguf, config: ModelConfig) -> _Vocab:
    model = src.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFConvertError(
            f"{src.path}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    pre = src.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConvertError(
            f"{src.path}: pre-tokenizer {pre!r} is not supported (only {sorted(_PRE_TOKENIZERS)})"
        )
    tokens = [str(t) for t in src.require("tokenizer.ggml.tokens")]
    types = [int(t) for t in src.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        raise GGUFConvertError(f"{src.path}: {len(types)} token types for {len(tokens)} tokens")
    if len(tokens) > config.vocab_size:
        raise GGUFConvertError(
            f"{src.path}: {len(tokens)} tokens, more than vocab_size {config.vocab_size}"
        )
    if len(set(tokens)) != len(tokens):
        raise GGUFConvertError(f"{src.path}: the token list has duplicates")
    merges = []
    for merge in src.get("tokenizer.ggml.merges", []):
        left, sep, right = str(merge).partition(" ")
        if not sep or not left or not right:
            raise GGUFConvertError(f"{src.path}: merge {merge!r} is not two tokens")
        merges.append((left, right))
    return _Vocab(tokens, types, merges, _PRE_TOKENIZERS[pre])


def build_tokenizer(vocab: _Vocab) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE, GPT-2 regex (digits one by one where
    the GGUF's pre-tokenizer says so), control tokens as special added tokens."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise GGUFConvertError(
            "writing tokenizer.json needs the 'tokenizers' package (pip install tokenizers)"
        ) from None
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=vocab.merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if vocab.digits_apart
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == _CONTROL]
    users = [t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in users])
    return tokenizer


def _tokenizer_config(src: _Gguf, vocab: _Vocab, config: ModelConfig) -> dict[str, Any]:
    unk = src.get("tokenizer.ggml.unknown_token_id")
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    data: dict[str, Any] = {
        # Loads tokenizer.json as written, whatever the model family.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(src.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(src.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(src.get("tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "bos_token": vocab.token(config.bos_token_id),
        "eos_token": vocab.token(eos),
        "pad_token": vocab.token(config.pad_token_id),
        "unk_token": vocab.token(unk),
    }
    template = src.get("tokenizer.chat_template")
    if template is not None:
        data["chat_template"] = str(template)
    return {key: value for key, value in data.items() if value is not None}


# -- writing the folder ------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write the HF-layout checkpoint of ``gguf_path`` as the folder ``out_dir``.

    ``out_dir`` must not exist (unless ``overwrite``): the folder appears whole, by a
    rename of a temporary sibling. Raises :class:`GGUFConvertError`.
    """
    src_path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not overwrite:
        raise GGUFConvertError(f"{out}: already exists (pass overwrite=True to replace it)")
    src = _open(src_path)
    tensor_names = {t.name for t in src.reader.tensors}
    config = _model_config(src, tensor_names)
    vocab = _vocab(src, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write_checkpoint(staging, config, _state_dict(src, config))
        build_tokenizer(vocab).save(str(staging / TOKENIZER_FILE))
        _write_json(staging / TOKENIZER_CONFIG_FILE, _tokenizer_config(src, vocab, config))
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.to_dict()["eos_token_id"],
            "pad_token_id": config.pad_token_id,
        }
        _write_json(
            staging / GENERATION_CONFIG_FILE,
            {key: value for key, value in generation.items() if value is not None},
        )
        _write_json(
            staging / CONVERSION_FILE,
            {
                "converter": "model_svc.gguf_convert",
                "converter_version": CONVERTER_VERSION,
                "source": src_path.name,
                "source_bytes": src_path.stat().st_size,
                "source_name": src.get("general.name"),
                "source_file_type": src.get("general.file_type"),
                "dtype": "float32",
            },
        )
        _make_readable(staging)
        _move_into_place(staging, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(staging)
    return out


def _make_readable(folder: Path) -> None:
    """The permissions of a plain ``mkdir`` and file write (``mkdtemp`` makes 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for file in folder.iterdir():
        os.chmod(file, 0o666 & ~umask)


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``; an existing ``out`` is first renamed aside."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
        os.rename(out, old / out.name)
    try:
        os.rename(staging, out)
    except OSError as exc:
        raise GGUFConvertError(
            f"{out}: could not move the converted folder into place ({exc})"
        ) from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def is_converted(folder: str | Path) -> bool:
    """Whether ``folder`` is a complete checkpoint written by this converter version."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in CONVERTED_FILES):
        return False
    try:
        marker = json.loads((folder / CONVERSION_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_svc.gguf_convert",
        description="Convert a llama GGUF file into a Hugging Face-layout checkpoint folder.",
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the folder to create")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        out = convert_gguf(args.gguf, args.out_dir, overwrite=args.overwrite)
    except GGUFConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
