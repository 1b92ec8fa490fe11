"""Re-running a forward pass writes the same bytes, only into its own slots, and
returns the same logits and sampled tokens (what a restart after a crash relies on)."""

from __future__ import annotations

import numpy as np
import torch

from model_svc.model import ExtendItem
from model_svc.sampling import SamplingParams, sample
from model_svc.tiny import BOS_ID

SAMPLING = [SamplingParams(temperature=0.9, top_p=0.95, seed=11), SamplingParams()]


def changed_slots(before: np.ndarray, after: np.ndarray, page_size: int) -> set[int]:
    """Token slots whose KV differs in any layer, K or V, head or dim."""
    differs = (before != after).any(axis=(1, 2, 4, 5))  # [pages + 1, page_size]
    pages, offsets = np.nonzero(differs)
    return set((pages * page_size + offsets).tolist())


def run_twice(bp, forward) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Run ``forward`` twice: same logits, same pool bytes, same sampled tokens.

    Returns the pool before and after, and the logits."""
    before = bp.kv_snapshot()
    first = forward()
    after_first = bp.kv_snapshot()
    second = forward()
    assert torch.equal(first, second)
    assert np.array_equal(after_first, bp.kv_snapshot())
    positions = [7, 7]
    assert torch.equal(
        sample(first, SAMPLING, positions)[0], sample(second, SAMPLING, positions)[0]
    )
    return before, after_first, first


def test_rerun_extend_and_decode(bound_pool) -> None:
    bp = bound_pool(4)
    pool, model = bp.pool, bp.model
    prompts = {"a": [BOS_ID, *b"Re-run me after a crash."], "b": [BOS_ID, *b"Me too."]}
    # "a" is chunked: its second chunk runs (twice) beside "b"'s whole prompt.
    bp.admit("a", prompts["a"])
    bp.extend([("a", prompts["a"][:10])])
    bp.admit("b", prompts["b"])
    chunks = [("a", prompts["a"][10:]), ("b", prompts["b"])]
    starts = [pool.request(rid).kv_len for rid, _ in chunks]
    new_slots = pool.alloc_extend([(rid, len(ids)) for rid, ids in chunks])
    items = [
        ExtendItem(pool.request(rid).row, start, ids)
        for (rid, ids), start in zip(chunks, starts, strict=True)
    ]
    before, after, logits = run_twice(bp, lambda: model.extend(items))
    assert changed_slots(before, after, pool.page_size) == set(new_slots.tolist())

    rids = list(prompts)
    decode_slots = pool.alloc_decode(rids)
    rows = np.array([pool.request(rid).row for rid in rids])
    seq_lens = np.array([pool.request(rid).kv_len for rid in rids])
    last = logits.argmax(dim=-1).tolist()
    before, after, _ = run_twice(bp, lambda: model.decode(rows, seq_lens, last))
    assert changed_slots(before, after, pool.page_size) == set(decode_slots.tolist())

    for rid in rids:
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)
