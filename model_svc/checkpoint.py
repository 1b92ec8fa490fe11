"""Load a Hugging Face-layout Llama checkpoint: ``config.json`` + ``*.safetensors``.

Tensors carry HF names (``model.layers.{i}.self_attn.q_proj.weight``, ...),
in one file or sharded with ``model.safetensors.index.json``. Every expected
tensor must be present exactly once with its expected shape, and nothing
else may be (an unknown tensor means a model this code would run wrongly).
Failures raise :class:`CheckpointError` naming the file and the tensor.

HF stores q/k projections in the "rotate_half" RoPE convention (dims ``i``
and ``i + head_dim/2`` pair up); :func:`model_svc.rope.apply_rope` uses it
too, so the weights load unpermuted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model_svc.config import ModelConfig
from model_svc.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Saved by old transformers versions; recomputed from the config.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_FILE_ERRORS = (OSError, SafetensorError, RuntimeError, ValueError)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by HF name, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (config.q_size, hidden),
            f"{prefix}.self_attn.k_proj.weight": (config.kv_size, hidden),
            f"{prefix}.self_attn.v_proj.weight": (config.kv_size, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, config.q_size),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def load_state_dict(
    path: str | Path, config: ModelConfig, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, checked against ``config`` and cast to ``dtype`` (on CPU)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    expected = expected_shapes(config)
    found = _tensor_files(directory)
    # A tied checkpoint may still carry lm_head.weight; HF ignores it and so do we.
    unused = {n for n in found if _IGNORED.fullmatch(n)}
    if config.tie_word_embeddings:
        unused.add("lm_head.weight")
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected) - unused)
    if missing:
        raise CheckpointError(f"{directory}: missing tensor(s) {_names(missing)}")
    if extra:
        raise CheckpointError(f"{directory}: unexpected tensor(s) {_names(extra)}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(found[name], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        state |= _read_tensors(file, names, expected, dtype)
    return state


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Which file holds each tensor: from the shard index, else from the files' headers."""
    index = directory / WEIGHTS_INDEX
    if index.exists():
        return _read_index(index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    found: dict[str, Path] = {}
    for file in files:
        for name in _file_keys(file):
            if name in found:
                raise CheckpointError(f"{file}: tensor {name} is also in {found[name].name}")
            found[name] = file
    return found


def _read_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
        found = {str(name): index.parent / str(file) for name, file in weight_map.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid shard index ({exc!r})") from None
    for file in sorted(set(found.values())):
        if file.parent != index.parent or not file.is_file():
            raise CheckpointError(f"{index}: names shard {file.name}, which does not exist")
    return found


def _file_keys(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except _FILE_ERRORS as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


def _read_tensors(
    file: Path, names: list[str], expected: dict[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    state = {}
    try:
        with safe_open(file, framework="pt", device="cpu") as handle:
            keys = set(handle.keys())
            for name in names:
                if name not in keys:
                    raise CheckpointError(
                        f"{file}: lacks tensor {name} (the shard index says here)"
                    )
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{file}: tensor {name} has shape {list(shape)}, the config needs "
                        f"{list(expected[name])}"
                    )
                state[name] = _checked(file, name, handle.get_tensor(name)).to(dtype)
    except _FILE_ERRORS as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    return state


def _checked(file: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise CheckpointError(f"{file}: tensor {name} is {tensor.dtype}, not floating point")
    if not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"{file}: tensor {name} holds NaN or infinite values")
    return tensor
