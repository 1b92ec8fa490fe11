"""The cuda backend's own code on the CPU, against a stand-in cupy (``tests/gpu/fake_cupy.py``).

What this covers without a GPU: the page-run copies (pointers, sizes, copy
kinds) between the "device" pool and the host store, the device
``req_to_token`` table kept equal to its host mirror, and asynchronous
offload: the stand-in's copies really wait in their stream until something
synchronizes it, so pages reused before their copy ran would corrupt the
host copy. The real-GPU versions of these tests are in ``test_cuda_backend.py``.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from memsvc.core import KVPool
from tests.core.test_host_store import fill_random
from tests.gpu import fake_cupy
from tests.helpers import small_layout


@pytest.fixture
def cuda_pool(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make())
    pools: list[KVPool] = []

    def factory(layout, **kwargs) -> KVPool:
        pools.append(KVPool(layout, backend="cuda", host_store_bytes=layout.kv_bytes, **kwargs))
        return pools[-1]

    yield factory
    for pool in pools:
        pool.close()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("async_offload", [False, True])
@pytest.mark.parametrize("pinned_host", [True, False])
def test_offload_load_round_trip(cuda_pool, page_size, async_offload, pinned_host) -> None:
    layout = small_layout(page_size=page_size, num_pages=256 // page_size)
    pool = cuda_pool(
        layout, async_offload=async_offload, backend_options={"pinned_host": pinned_host}
    )
    rows = [pool.open_request(rid) for rid in ("r", "gap")]
    pool.open_request("blocker")
    for _ in range(37):  # decoding side by side: r's pages alternate with gap's
        pool.alloc_decode_rows(np.array(rows))
    slots = pool.slots("r")
    assert (np.diff(slots[::page_size] // page_size) != 1).any(), "want several page runs"
    kv = fill_random(pool, slots, seed=page_size)
    pool.offload("r")
    pool.release("r", is_insert=False)
    blocker = pool.alloc_extend([("blocker", 37)])
    pool.buffers.write_slots(blocker, np.zeros_like(kv))
    pool.open_request("r")
    new_slots = pool.load("r")
    assert not np.intersect1d(new_slots, slots).size, "the reload should land on other pages"
    assert np.array_equal(pool.buffers.read_slots(new_slots), kv)
    for rid in ("r", "blocker", "gap"):
        pool.release(rid, is_insert=False)
    pool.check_integrity(idle=True)


def test_async_offload_copy_is_deferred_and_reused_pages_wait_for_it(cuda_pool) -> None:
    """The victim fills the pool; its copy has not run when its pages are freed; the
    next allocation needs exactly those pages and must wait for the copy's event."""
    layout = small_layout(page_size=4, num_pages=8)
    pool = cuda_pool(layout, async_offload=True)
    pool.open_request("r")
    slots = pool.alloc_extend([("r", 32)])
    kv = fill_random(pool, slots, seed=1)
    pool.offload("r")
    fence = pool.host_store.fence("r")
    assert not fence.done(), "the stand-in's copy should still be queued"
    pool.release("r", is_insert=False)
    assert pool.allocator.num_pending_pages == 8
    pool.open_request("blocker")
    blocker = pool.alloc_extend([("blocker", 32)])
    assert fence.done(), "pages were handed out before the copy reading them had run"
    pool.buffers.write_slots(blocker, np.full_like(kv, -3.0))
    pool.release("blocker", is_insert=False)
    assert np.array_equal(pool.host_store.read("r"), kv)
    pool.open_request("r")
    assert np.array_equal(pool.buffers.read_slots(pool.load("r")), kv)
    pool.release("r", is_insert=False)
    pool.check_integrity(idle=True)


def test_device_table_follows_the_host_mirror(cuda_pool) -> None:
    layout = small_layout(page_size=4, num_pages=32)
    pool = cuda_pool(layout)
    rows = [pool.open_request(rid) for rid in ("a", "b")]
    pool.alloc_extend([("a", 6), ("b", 9)])
    for _ in range(5):
        pool.alloc_decode_rows(np.array(rows))
    assert np.array_equal(np.asarray(pool.buffers.req_to_token_device), pool.buffers.req_to_token)
    assert pool.buffers.req_to_token[rows[1], :14].tolist() == pool.slots("b").tolist()
    for rid in ("a", "b"):
        pool.release(rid, is_insert=False)
    assert not np.asarray(pool.buffers.req_to_token_device)[rows].any()
    pool.check_integrity(idle=True)


def test_the_handle_carries_ipc_handles(cuda_pool) -> None:
    pool = cuda_pool(small_layout())
    handle = pool.buffers.handle()
    assert handle["backend"] == "cuda" and handle["device"] == 0
    assert len(handle["kv_ipc"]) == 64 and handle["kv_ipc"] != handle["req_to_token_ipc"]
