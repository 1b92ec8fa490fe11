"""Rotary position embedding: the inverse frequencies (with ``rope_scaling``:
``linear`` or ``llama3``) and their application to queries and keys, as Hugging
Face's Llama computes them. :class:`model_svc.model.LlamaModel` builds the
cos/sin tables from these per forward pass."""

from __future__ import annotations

import math

import torch

from model_svc.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, ``[head_dim // 2]``, with rope_scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    return inv_freq if scaling is None else _scale_inv_freq(inv_freq, scaling)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(
        wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq
    )
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= old_len / scaling.high_freq_factor) & (
        wavelen <= old_len / scaling.low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's "rotate_half" convention: dims ``i`` and ``i + dim/2`` form a pair."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
