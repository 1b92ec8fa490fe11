"""Next-token choice: greedy by default; temperature / top-k / top-p with a per-request seed.

A random draw uses its own ``torch.Generator`` seeded from ``(seed, position)``,
so the same request at the same position always draws the same token,
whatever else is in the batch and however often the step is re-run (a
re-run after a crash returns the same tokens).

Each row is drawn on its own and never fails: a temperature below SGLang's
``_SAMPLING_EPS`` is greedy, the most likely token always survives the top-p
cut, and a row whose distribution cannot be drawn from (NaN or infinite
logits) takes its most likely token, so one row can never break the batch.

Logprobs are SGLang's: of the distribution the token is drawn from, i.e. the
log-softmax of the raw logits for a greedy row and of the temperature-scaled
logits for a sampled one (before top-k, top-p and min-p), after the
suppressed ids (``min_new_tokens``) are masked out.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from pydantic import Field

from model_svc.protocol import SamplingSpec

_MASK64 = (1 << 64) - 1


class SamplingParams(SamplingSpec):
    """A :class:`SamplingSpec` made in process (tests, tools), with the sampler's own
    bounds where they are looser than the wire's: any finite temperature >= 0, any
    top_p in (0, 1] (the sampler keeps the top token when float32 rounds it to 0);
    ``top_k`` None for "no cut", else at least 1 (the wire's 0). The sampler takes both.
    """

    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)


class SampleResult(NamedTuple):
    token_ids: torch.Tensor  # [n] int64
    # [n] float32: log-probability of each chosen token (see the module docstring);
    # None when no request asked.
    logprobs: torch.Tensor | None


# Per row: None, or the top-k (logprobs, token ids), most likely first.
TopLogprobs = list[tuple[list[float], list[int]] | None]


GREEDY = SamplingSpec()


def sample(
    logits: torch.Tensor, params: Sequence[SamplingSpec], positions: Sequence[int]
) -> SampleResult:
    """One token per row of ``logits [n, vocab]``.

    ``positions[i]`` is where row ``i``'s token will sit in its sequence (its
    length so far); with the request's seed it fixes the random draw.
    """
    if logits.dim() != 2 or not logits.shape[0] == len(params) == len(positions):
        raise ValueError("sample needs logits [n, vocab] and n params and positions")
    logits = suppressed(logits.float(), params)
    token_ids = logits.argmax(dim=-1)
    for i, (param, position) in enumerate(zip(params, positions, strict=True)):
        if not param.is_greedy:
            token_ids[i] = _draw(logits[i], param, int(position))
    logprobs = None
    if any(param.logprobs for param in params):
        logprobs = sampling_logprobs(logits, params).gather(1, token_ids[:, None])[:, 0]
    return SampleResult(token_ids, logprobs)


def suppressed(logits: torch.Tensor, params: Sequence[SamplingSpec]) -> torch.Tensor:
    """``logits`` with each row's ``suppress_token_ids`` at -inf (a copy if any)."""
    if not any(param.suppress_token_ids for param in params):
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i, param in enumerate(params):
        ids = [t for t in param.suppress_token_ids if 0 <= t < vocab]
        if ids:
            logits[i, ids] = -math.inf
    return logits


def sampling_logprobs(logits: torch.Tensor, params: Sequence[SamplingSpec]) -> torch.Tensor:
    """Log-softmax of each row as it is sampled: raw if greedy, else over the temperature."""
    scale = torch.tensor(
        [1.0 if p.is_greedy else p.temperature for p in params], dtype=logits.dtype
    ).to(logits.device)
    return torch.log_softmax(logits / scale[:, None], dim=-1)


def top_logprobs(logprobs: torch.Tensor, nums: Sequence[int]) -> TopLogprobs:
    """The ``nums[i]`` most likely tokens of row ``i`` of ``logprobs [n, vocab]`` (0: None).

    Ties keep vocabulary order (a stable sort), so the answer is reproducible.
    """
    top: TopLogprobs = [None] * len(nums)
    k = min(max(nums, default=0), logprobs.shape[-1])
    if k <= 0:
        return top
    values, order = logprobs.float().cpu().sort(dim=-1, descending=True, stable=True)
    values, order = values[:, :k].tolist(), order[:, :k].tolist()
    for i, num in enumerate(nums):
        if num > 0:
            top[i] = (values[i][:num], order[i][:num])
    return top


def _draw(row: torch.Tensor, param: SamplingSpec, position: int) -> int:
    """Sample from one row: scale, keep the top-k, the top-p nucleus, the min-p share, draw."""
    # NaN sorts above everything: make it the least likely token instead.
    scaled = torch.nan_to_num(row.cpu(), nan=-math.inf) / param.temperature
    # stable: equal logits keep vocabulary order, so the draw is reproducible
    sorted_logits, order = scaled.sort(descending=True, stable=True)
    if param.top_k:  # 0 (the wire's) or None: no cut
        sorted_logits, order = sorted_logits[: param.top_k], order[: param.top_k]
    probs = torch.softmax(sorted_logits, dim=-1)
    if param.top_p < 1:
        # Keep a token while the mass before it is under top_p; the first always stays,
        # even for a top_p too small for float32 or a mass that is NaN.
        keep = (probs.cumsum(0) - probs) < param.top_p
        keep[0] = True
        probs, order = probs[keep], order[keep]
    if param.min_p > 0:
        keep = probs >= probs[0] * param.min_p  # probs are sorted: probs[0] is the largest
        keep[0] = True
        probs, order = probs[keep], order[keep]
    if not _drawable(probs):
        return int(order[0])  # no distribution to draw from: the most likely token
    generator = torch.Generator().manual_seed(draw_seed(param.seed, position))
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(order[choice])


def _drawable(probs: torch.Tensor) -> bool:
    """What ``torch.multinomial`` accepts: finite, non-negative, some mass."""
    return bool(torch.isfinite(probs).all() and (probs >= 0).all() and probs.sum() > 0)


def draw_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from ``(seed, position)`` (splitmix64 of their mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_from_rid(rid: str) -> int:
    """A stable per-request seed for requests that did not choose one."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")
