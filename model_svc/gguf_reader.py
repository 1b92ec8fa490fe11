"""Reading a llama-architecture GGUF file: its metadata as a :class:`ModelConfig`, its
tensors as a float32 HF-named state dict (:mod:`model_svc.gguf_convert` writes them).

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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_svc.checkpoint import expected_shapes
from model_svc.config import ModelConfig, RopeScaling
from model_svc.errors import CheckpointError

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


@dataclass
class GgufFile:
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


def open_gguf(path: Path) -> GgufFile:
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
    return GgufFile(path, reader)


def model_config(src: GgufFile, tensor_names: set[str]) -> ModelConfig:
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


def _rope_scaling(src: GgufFile, tensor_names: set[str]) -> RopeScaling | None:
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1's frequency factors, baked into a tensor; not recovered here.
        raise GGUFConvertError(f"{src.path}: rope_freqs.weight (llama3 RoPE) is not supported")
    kind = src.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", src.scalar("llama.rope.scaling.factor", float))
    raise GGUFConvertError(f"{src.path}: rope scaling {kind!r} is not supported")


def state_dict(src: GgufFile, config: ModelConfig) -> dict[str, torch.Tensor]:
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
