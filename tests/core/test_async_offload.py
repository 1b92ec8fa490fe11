"""Asynchronous offload: a page goes back to the free list only after the copy reading it.

The copy thread of the shm backend is held at a gate, so the copy is still
"in flight" while the test frees the victim's pages and reuses the pool. If
pages were freed before their copy finished, the next owner's writes would
land in the host copy and the byte comparisons below would fail.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from memsvc.core.allocator import OWNER_PENDING
from memsvc.core.errors import CopyFailedError, DoubleFreeError
from tests.core.test_host_store import fill_random
from tests.helpers import small_layout


def gate_copies(pool) -> threading.Event:
    """Hold every offload copy until the returned event is set."""
    gate = threading.Event()
    gather = pool.buffers.gather_pages

    def gated(pages: np.ndarray, out: np.ndarray) -> None:
        assert gate.wait(timeout=30), "the test never opened the copy gate"
        gather(pages, out)

    pool.buffers.gather_pages = gated
    return gate


def offloaded_victim(make_pool, num_pages: int, victim_pages: int):
    layout = small_layout(page_size=4, num_pages=num_pages)
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes, async_offload=True)
    gate = gate_copies(pool)
    pool.open_request("r")
    slots = pool.alloc_extend([("r", victim_pages * 4)])
    kv = fill_random(pool, slots, seed=victim_pages)
    pool.offload("r")
    fence = pool.host_store.fence("r")
    pool.release("r", is_insert=False)
    return pool, gate, slots, kv, fence


def test_freed_pages_wait_for_the_copy_and_count_as_available(make_pool):
    pool, gate, slots, _, fence = offloaded_victim(make_pool, num_pages=16, victim_pages=8)
    assert not fence.done()
    victim_pages = np.unique(slots // 4)
    assert (pool.allocator.owners()[victim_pages] == OWNER_PENDING).all()
    assert pool.allocator.num_pending_pages == 8
    assert pool.available_size() == pool.capacity  # pending pages are available, after a wait
    pool.check_integrity()
    with pytest.raises(DoubleFreeError):
        pool.allocator.free_pages(victim_pages[:1])
    gate.set()
    pool.settle_copies()
    assert pool.allocator.num_pending_pages == 0
    pool.host_discard("r")
    pool.check_integrity(idle=True)


def test_allocation_with_room_elsewhere_does_not_reuse_pages_in_flight(make_pool):
    pool, gate, slots, kv, fence = offloaded_victim(make_pool, num_pages=16, victim_pages=8)
    pool.open_request("other")
    other = pool.alloc_extend([("other", 32)])  # the 8 pages nobody freed
    assert not fence.done(), "the allocation waited although free pages were there"
    assert not np.intersect1d(other // 4, slots // 4).size
    pool.buffers.write_slots(other, np.zeros_like(kv))
    gate.set()
    pool.release("other", is_insert=False)
    pool.open_request("r")
    assert np.array_equal(pool.buffers.read_slots(pool.load("r")), kv)
    pool.release("r", is_insert=False)
    pool.check_integrity(idle=True)


def test_allocation_that_needs_pages_in_flight_waits_for_their_copy(make_pool):
    # The victim fills the pool: the next allocation can only have its pages.
    pool, gate, slots, kv, fence = offloaded_victim(make_pool, num_pages=8, victim_pages=8)
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    try:
        pool.open_request("blocker")
        blocker = pool.alloc_extend([("blocker", 32)])
    finally:
        opener.cancel()
        gate.set()
    assert fence.done(), "pages in flight were handed out before their copy finished"
    assert np.array_equal(np.unique(blocker // 4), np.unique(slots // 4))
    pool.buffers.write_slots(blocker, np.zeros_like(kv))  # overwrite the reused pages at once
    pool.release("blocker", is_insert=False)
    assert np.array_equal(pool.host_store.read("r"), kv)
    pool.open_request("r")
    assert np.array_equal(pool.buffers.read_slots(pool.load("r")), kv)
    pool.release("r", is_insert=False)
    pool.check_integrity(idle=True)


def test_pages_freed_by_eviction_also_wait_for_the_copy(make_pool):
    """Offload, then release *into the tree*; evicting those pages must wait too."""
    layout = small_layout(page_size=4, num_pages=8)
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes, async_offload=True)
    gate = gate_copies(pool)
    tokens = np.arange(100, 132)
    pool.open_request("r")
    slots = pool.alloc_extend([("r", 32)])
    kv = fill_random(pool, slots, seed=3)
    pool.offload("r")
    pool.release("r", tokens, is_insert=True)
    assert pool.evictable_size() == 32
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    try:
        pool.open_request("blocker")
        blocker = pool.alloc_extend([("blocker", 32)])  # evicts the tree, then waits
    finally:
        opener.cancel()
        gate.set()
    assert pool.host_store.fence("r").done()
    pool.buffers.write_slots(blocker, np.zeros_like(kv))
    assert np.array_equal(pool.host_store.read("r"), kv)
    pool.release("blocker", is_insert=False)
    pool.host_discard("r")
    pool.check_integrity(idle=True)


def test_a_failed_copy_is_reported_on_load_and_frees_everything(make_pool):
    layout = small_layout(page_size=4, num_pages=16)
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes, async_offload=True)

    def broken(pages: np.ndarray, out: np.ndarray) -> None:
        raise OSError("simulated copy failure")

    pool.buffers.gather_pages = broken
    pool.open_request("r")
    pool.alloc_extend([("r", 10)])
    pool.offload("r")
    pool.release("r", is_insert=False)
    pool.open_request("r")
    with pytest.raises(CopyFailedError, match="simulated copy failure"):
        pool.load("r")
    assert "r" not in pool.host_store
    pool.release("r", is_insert=False)
    pool.settle_copies()
    pool.check_integrity(idle=True)


@pytest.mark.parametrize("seed", range(3))
def test_many_overlapping_offloads_stay_byte_exact(make_pool, seed):
    """Offload and free victims back to back while earlier copies still run."""
    rng = np.random.default_rng(seed)
    layout = small_layout(page_size=4, num_pages=24)
    pool = make_pool(layout, host_store_bytes=layout.kv_bytes * 4, async_offload=True)
    gate = gate_copies(pool)
    expected = {}
    for i in range(12):
        rid = f"v{i}"
        pool.open_request(rid)
        num_tokens = int(rng.integers(1, 25))  # <= 6 pages: three fit with copies held
        slots = pool.alloc_extend([(rid, num_tokens)])
        assert slots is not None
        expected[rid] = fill_random(pool, slots, seed=seed * 100 + i)
        pool.offload(rid)
        pool.release(rid, is_insert=False)
        if i == 2:
            gate.set()  # let the first batch of copies run while more are issued
        pool.check_integrity()
    gate.set()
    for rid, kv in expected.items():
        pool.open_request(rid)
        assert np.array_equal(pool.buffers.read_slots(pool.load(rid)), kv), rid
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)
