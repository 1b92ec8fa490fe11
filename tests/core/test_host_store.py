"""HostStore: byte-exact offload / load round trips, capacity, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core.errors import (
    DuplicateRequestError,
    HostStoreFullError,
    InvalidArgumentError,
    UnknownRequestError,
)
from tests.helpers import small_layout


def fill_random(pool, slots: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    layout = pool.layout
    shape = (slots.size, layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    data = rng.standard_normal(shape).astype(layout.storage_dtype)
    pool.buffers.write_slots(slots, data)
    return data


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_offload_then_load_into_other_pages_is_byte_identical(make_pool, page_size, num_tokens):
    layout = small_layout(page_size=page_size, num_pages=160 // page_size * 2)
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes)
    pool.open_request("r")
    pool.open_request("blocker")
    slots = pool.alloc_extend([("r", num_tokens)])
    kv = fill_random(pool, slots, seed=num_tokens)

    pool.offload("r")
    assert np.array_equal(pool.host_store.read("r"), kv)
    pool.release("r", is_insert=False)
    # Occupy the freed pages, so the reload must land on different ones.
    pool.alloc_extend([("blocker", num_tokens)])
    fill_random(pool, pool.slots("blocker"), seed=99)

    pool.open_request("r")
    new_slots = pool.load("r")
    assert new_slots is not None
    assert not np.intersect1d(new_slots // page_size, slots // page_size).size
    assert pool.buffers.read_slots(new_slots).tobytes() == kv.tobytes()
    assert "r" not in pool.host_store and pool.host_store.used_bytes == 0

    pool.release("r", is_insert=False)
    pool.release("blocker", is_insert=False)
    pool.check_integrity(idle=True)


def test_unaligned_slots_take_the_token_path(make_pool) -> None:
    """Slots not laid out page by page (not what the allocator makes) still round-trip."""
    layout = small_layout(page_size=4)
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes)
    src = np.array([9, 22, 23, 8, 41], dtype=np.int64)  # scattered offsets
    kv = fill_random(pool, src, seed=1)
    pool.host_store.offload("x", src)
    dst = np.array([30, 13, 14, 50, 51], dtype=np.int64)
    pool.host_store.load("x", dst)
    assert pool.buffers.read_slots(dst).tobytes() == kv.tobytes()
    pool.check_integrity(idle=True)


def test_full_store_refuses_and_changes_nothing(make_pool) -> None:
    layout = small_layout(page_size=4)
    pool = make_pool(layout, host_store_bytes=3 * layout.bytes_per_page)
    pool.open_request("a")
    pool.open_request("b")
    pool.alloc_extend([("a", 8), ("b", 8)])
    assert pool.offload("a") == 2 * layout.bytes_per_page
    used = pool.host_store.used_bytes
    with pytest.raises(HostStoreFullError, match="host store full"):
        pool.offload("b")
    assert pool.host_store.used_bytes == used and "b" not in pool.host_store
    assert pool.offload("b", num_tokens=4) == layout.bytes_per_page
    assert pool.host_store.free_bytes == 0
    for rid in ("a", "b"):
        pool.host_discard(rid)
        pool.release(rid, is_insert=False)
    assert pool.host_store.free_bytes == pool.host_store.capacity_bytes
    pool.check_integrity(idle=True)


def test_fragmented_store_splits_an_entry_across_extents(make_pool) -> None:
    layout = small_layout(page_size=1, num_pages=32)
    pool = make_pool(layout, host_store_bytes=6 * layout.bytes_per_page)
    slots = {}
    for rid in "abc":
        pool.open_request(rid)
        slots[rid] = pool.alloc_extend([(rid, 2)])
        fill_random(pool, slots[rid], seed=ord(rid))
        pool.offload(rid)
    pool.host_discard("a")
    pool.host_discard("c")  # free runs: [0,2) and [4,6)
    pool.open_request("d")
    d_slots = pool.alloc_extend([("d", 4)])
    d_kv = fill_random(pool, d_slots, seed=4)
    pool.offload("d")
    assert len(pool.host_store._entries["d"].extents) == 2
    assert np.array_equal(pool.host_store.read("d"), d_kv)
    pool.release("d", is_insert=False)
    pool.open_request("d2")
    assert pool.host_store.num_tokens("d") == 4
    pool.host_store.load("d", pool.alloc_extend([("d2", 4)]))
    assert pool.buffers.read_slots(pool.slots("d2")).tobytes() == d_kv.tobytes()
    pool.host_discard("b")
    for rid in ("a", "b", "c", "d2"):
        pool.release(rid, is_insert=False)
    assert pool.host_store.free_bytes == 6 * layout.bytes_per_page
    pool.check_integrity(idle=True)


def test_bad_host_store_calls(make_pool) -> None:
    layout = small_layout()
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes)
    pool.open_request("a")
    pool.alloc_extend([("a", 5)])
    pool.offload("a")
    with pytest.raises(DuplicateRequestError):
        pool.offload("a")
    with pytest.raises(UnknownRequestError):
        pool.host_discard("zzz")
    with pytest.raises(UnknownRequestError):
        pool.host_store.load("zzz", np.array([4]))
    with pytest.raises(InvalidArgumentError):
        pool.host_store.load("a", np.array([4, 5]))  # wrong length
    with pytest.raises(InvalidArgumentError):
        pool.offload("a", num_tokens=6)
    with pytest.raises(InvalidArgumentError):
        pool.load("a")  # the row still holds KV
    assert pool.host_store.num_tokens("a") == 5
    pool.host_discard("a")
    pool.release("a", is_insert=False)
    pool.check_integrity(idle=True)
