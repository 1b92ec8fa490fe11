"""paged_attention.attention_mask: causal, and within a window, at any offsets, against a
brute-force reading of transformers' rule (query i sees key j iff i - W < j <= i)."""

from __future__ import annotations

import itertools

import pytest
import torch

from model_svc.errors import ModelLayoutError
from model_svc.paged_attention import ExtendAttention, PoolRows, attention_mask


def brute(query_start: int, n: int, key_start: int, k: int, window: int | None) -> torch.Tensor:
    mask = torch.zeros(n, k, dtype=torch.bool)
    for i, c in itertools.product(range(n), range(k)):
        q, j = query_start + i, key_start + c
        mask[i, c] = j <= q and (window is None or j > q - window)
    return mask


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 8, 100])
@pytest.mark.parametrize(("query_start", "key_start"), [(0, 0), (4, 0), (6, 2), (6, 6)])
@pytest.mark.parametrize("num_new", [1, 3, 7])
def test_the_mask_is_transformers_rule(
    window: int | None, query_start: int, key_start: int, num_new: int
) -> None:
    num_keys = query_start + num_new - key_start
    got = attention_mask(query_start, num_new, key_start, num_keys, window, torch.device("cpu"))
    want = brute(query_start, num_new, key_start, num_keys, window)
    if got is None:  # plain causal, which SDPA's is_causal applies
        assert query_start == key_start
        got = torch.ones(num_new, num_keys, dtype=torch.bool).tril()
    assert torch.equal(got, want)


def test_an_extend_context_must_reach_the_first_querys_window() -> None:
    kv = torch.zeros(5, 1, 2, 4, 1, 2)
    pool = PoolRows.of(kv, 4)
    slots = torch.arange(4, 4 + 10)
    seq = ExtendAttention.seq(pool, slots[3:], 6, window=4, context_start=3)  # keys 3.. for 6..
    assert seq.context_start == 3 and seq.num_new == 4 and seq.mask is not None
    with pytest.raises(ModelLayoutError, match="misses keys"):
        ExtendAttention.seq(pool, slots[4:], 6, window=4, context_start=4)
    with pytest.raises(ModelLayoutError, match="every new token"):
        ExtendAttention.seq(pool, slots[7:], 6, window=4, context_start=7)
