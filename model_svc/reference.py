"""A dense reference for tests: the same weights, contiguous per-request K/V, no pool.

It shares :meth:`LlamaModel.run_layers` (embedding, norms, RoPE, MLP) with
the paged model and replaces only the part under test: where K/V live and
how attention reads them. Attention here is written out (scores, causal
mask, softmax) rather than going through ``scaled_dot_product_attention``;
a sliding-window layer's mask also hides keys ``j <= i - W`` from query ``i``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from model_svc.model import LlamaModel


class DenseKV:
    """K and V of one request, ``[seq_len, kv_heads, dim]`` per layer, grown by ``torch.cat``."""

    def __init__(self, model: LlamaModel) -> None:
        cfg = model.config
        empty = torch.empty(0, cfg.num_key_value_heads, cfg.head_dim, dtype=model.dtype)
        self.keys = [empty.to(model.device)] * cfg.num_hidden_layers
        self.values = [empty.to(model.device)] * cfg.num_hidden_layers
        self.windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]

    @property
    def seq_len(self) -> int:
        return self.keys[0].shape[0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append the new tokens' K/V, then causal attention of ``q`` over everything so far."""
        self.keys[layer] = torch.cat((self.keys[layer], k))
        self.values[layer] = torch.cat((self.values[layer], v))
        keys, values = self.keys[layer], self.values[layer]
        num_new, num_heads, dim = q.shape
        num_kv_heads = keys.shape[1]
        total = keys.shape[0]
        # Query head h reads KV head h // groups: split heads as [kv_heads, groups].
        q = q.view(num_new, num_kv_heads, num_heads // num_kv_heads, dim)
        scores = torch.einsum("nkgd,lkd->kgnl", q, keys) / math.sqrt(dim)
        query_pos = torch.arange(total - num_new, total, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        hidden = key_pos > query_pos
        if self.windows[layer] is not None:
            hidden = hidden | (key_pos <= query_pos - self.windows[layer])
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), -1).to(
            q.dtype
        )
        out = torch.einsum("kgnl,lkd->nkgd", probs, values)
        return out.reshape(num_new, num_heads * dim)


@torch.inference_mode()
def forward_dense(
    model: LlamaModel, cache: DenseKV, token_ids: Sequence[int] | np.ndarray
) -> torch.Tensor:
    """Run ``token_ids`` after what ``cache`` holds; float32 logits ``[n, vocab]`` of each."""
    tokens = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=model.device)
    positions = torch.arange(cache.seq_len, cache.seq_len + tokens.numel(), device=model.device)
    return model.logits(model.run_layers(tokens, positions, cache.attend))


def dense_logits(model: LlamaModel, token_ids: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Logits ``[n, vocab]`` at every position of ``token_ids``, from one fresh pass."""
    return forward_dense(model, DenseKV(model), token_ids)


def generate_dense(
    model: LlamaModel, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int
) -> list[int]:
    """Greedy continuation of ``prompt_ids``: the prompt in one pass, then one token a step."""
    cache = DenseKV(model)
    logits = forward_dense(model, cache, prompt_ids)[-1]
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        generated.append(int(logits.argmax()))
        if len(generated) < max_new_tokens:
            logits = forward_dense(model, cache, generated[-1:])[-1]
    return generated
