"""Moving a request's KV to other pages (offload, release, reopen, load) changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from model_svc.tiny import BOS_ID

SHARED = [BOS_ID, *b"Offloaded requests come back on other pages. "]
PROMPTS = {"moved": [*SHARED, *b"Me!"], "stays": [BOS_ID, *b"I stay where I am."]}
NUM_BEFORE, NUM_AFTER = 6, 24


def pages_of(slots: np.ndarray, page_size: int) -> set[int]:
    return set((slots // page_size).tolist())


def run_without_moving(bound_pool, page_size: int) -> dict[str, list[int]]:
    bp = bound_pool(page_size)
    outputs = bp.generate(PROMPTS, NUM_AFTER)
    for rid in PROMPTS:
        bp.pool.release(rid, is_insert=False)
    bp.pool.check_integrity(idle=True)
    return outputs


@pytest.mark.parametrize("with_cached_prefix", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_offload_and_load_to_other_pages_keeps_tokens(
    bound_pool, page_size: int, with_cached_prefix: bool
) -> None:
    expected = run_without_moving(bound_pool, page_size)
    bp = bound_pool(page_size, host_store_bytes=4 << 20)
    if with_cached_prefix:  # "moved" then starts on a tree prefix that it holds locked
        warm = bp.generate({"warm": SHARED}, 2)["warm"]
        bp.finish("warm", SHARED, warm)
    outputs = bp.generate(PROMPTS, NUM_BEFORE)
    if with_cached_prefix:
        assert bp.pool.request("moved").protected_len > 0

    old_slots = bp.pool.slots("moved")
    bp.pool.offload("moved")
    bp.pool.release("moved", is_insert=False)
    # Another request takes the freed pages first, so the load lands elsewhere.
    bp.pool.open_request("blocker")
    assert bp.pool.alloc_extend([("blocker", old_slots.size)]) is not None
    bp.pool.open_request("moved")
    new_slots = bp.pool.load("moved")
    assert new_slots is not None
    assert not pages_of(new_slots, page_size) & pages_of(old_slots, page_size)
    bp.pool.release("blocker", is_insert=False)
    bp.pool.check_integrity()

    outputs = bp.continue_decode(outputs, NUM_AFTER)
    assert outputs == expected
    for rid in PROMPTS:
        bp.pool.release(rid, is_insert=False)
    bp.pool.check_integrity(idle=True)
