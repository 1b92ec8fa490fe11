"""The host store of a hybrid (sliding-window) pool: offload keeps every position's full KV
and the SWA KV of the window alone; load brings both back into fresh pages (SWA pages for
the window only) and restores the window; retract by offload on a hybrid pool."""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core import KVPool, PoolLayout
from memsvc.core.errors import HostStoreFullError
from memsvc.core.swa_host_store import HybridHostStore, split_host_bytes

F, S = "full_attention", "sliding_attention"
PS, W = 4, 10


def pool_of(
    layer_types=(S, F, S),
    num_pages: int = 32,
    swa_num_pages: int = 12,
    host_store_bytes: int = 1 << 20,
    async_offload: bool = False,
) -> KVPool:
    layout = PoolLayout(
        num_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=W,
        swa_num_pages=swa_num_pages,
        num_kv_heads=1,
        head_dim=2,
        page_size=PS,
        num_pages=num_pages,
        max_running_requests=4,
        max_context_len=128,
        dtype="float32",
    )
    return KVPool(layout, host_store_bytes=host_store_bytes, async_offload=async_offload)


def write(pool: KVPool, rid: str, start: int, slots: np.ndarray, salt: int) -> None:
    """Position p's KV: full 1000 * salt + p, SWA -(1000 * salt + p)."""
    f2s = pool.buffers.full_to_swa_page
    for i, slot in enumerate(slots.tolist()):
        value = 1000 * salt + start + i
        pool.buffers.kv[slot // PS, :, :, slot % PS] = value
        pool.buffers.swa_kv[f2s[slot // PS], :, :, slot % PS] = -value


def read(pool: KVPool, rid: str, start: int) -> tuple[list[float], list[float]]:
    slots = pool.slots(rid)
    f2s = pool.buffers.full_to_swa_page
    full = pool.buffers.kv[slots // PS, 0, 0, slots % PS, 0, 0].tolist()
    tail = slots[start:]
    assert f2s[tail // PS].all(), "a window position has no SWA page"
    swa = pool.buffers.swa_kv[f2s[tail // PS], 0, 0, tail % PS, 0, 0].tolist()
    return full, swa


def grow(pool: KVPool, rid: str, prompt: int, decode_steps: int, salt: int) -> None:
    pool.open_request(rid)
    write(pool, rid, 0, pool.alloc_extend([(rid, prompt)]), salt)
    for _ in range(decode_steps):
        start = pool.request(rid).kv_len
        write(pool, rid, start, pool.alloc_decode([rid]), salt)


@pytest.mark.parametrize("async_offload", [False, True])
def test_offload_keeps_the_window_and_load_restores_both_pools(async_offload: bool) -> None:
    with pool_of(async_offload=async_offload) as pool:
        grow(pool, "a", 21, 6, salt=1)  # 27 tokens: SWA held from floor_page(27 - 1 - W) = 16
        row = pool.request("a").row
        assert pool.swa.evicted_lens[row] == 16
        store = pool.host_store
        assert isinstance(store, HybridHostStore)
        nbytes = pool.offload("a")
        # the SWA tail of 27 tokens: from floor_page(27 - W) = 16, 3 pages of 2 SWA layers
        assert store.swa_from("a") == 16 and store.num_tokens("a") == 27
        page_bytes = 2 * 2 * PS * 4  # k and v, head_dim 2, float32
        assert nbytes == 7 * page_bytes * 1 + 3 * page_bytes * 2
        assert nbytes == store.entry_bytes("a") == store.used_bytes
        pool.release("a", is_insert=False)
        pool.check_integrity()
        assert pool.full_available_size() == pool.capacity
        assert pool.swa_available_size() == pool.swa_capacity

        grow(pool, "b", 12, 0, salt=2)  # other pages, so the load lands elsewhere
        pool.open_request("a")
        slots = pool.load("a")
        assert slots is not None and slots.size == 27
        full, swa = read(pool, "a", 16)
        assert full == [1000 + p for p in range(27)]
        assert swa == [-(1000 + p) for p in range(16, 27)]
        # SWA pages for the window alone: 3 for "a" (and 3 for "b")
        f2s = pool.buffers.full_to_swa_page
        assert not f2s[slots[:16:PS] // PS].any()
        assert pool.swa_available_size() == pool.swa_capacity - 6 * PS
        assert pool.swa.evicted_lens[pool.request("a").row] == 16
        assert len(store) == 0 and store.used_bytes == 0
        pool.check_integrity()
        # it decodes on: the window slides as before the offload
        for _ in range(5):
            start = pool.request("a").kv_len
            write(pool, "a", start, pool.alloc_decode(["a"]), salt=1)
            pool.check_integrity()
        full, swa = read(pool, "a", 20)
        assert full == [1000 + p for p in range(32)]
        assert swa == [-(1000 + p) for p in range(20, 32)]
        pool.release("a", is_insert=False)
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_load_needs_swa_pages_for_the_window_only() -> None:
    # 60 tokens need 15 full pages; the SWA pool has 6 pages, the window 3
    with pool_of(num_pages=32, swa_num_pages=6) as pool:
        pool.open_request("a")
        for _ in range(15):
            start = pool.request("a").kv_len
            write(pool, "a", start, pool.alloc_extend([("a", 4)]), salt=3)
        assert pool.request("a").kv_len == 60
        pool.offload("a")
        pool.release("a", is_insert=False)
        pool.open_request("a")
        slots = pool.load("a")
        assert slots is not None
        full, swa = read(pool, "a", 48)
        assert full == [3000 + p for p in range(60)]
        assert swa == [-(3000 + p) for p in range(48, 60)]
        pool.check_integrity()
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)


def test_retract_by_offload_on_a_hybrid_pool_and_resume() -> None:
    with pool_of(num_pages=16, swa_num_pages=8) as pool:
        for rid, salt in (("a", 1), ("b", 2)):
            grow(pool, rid, 16, 0, salt)  # 16 tokens each: the SWA pool is full
        assert pool.swa_available_size() == 0
        rows = [pool.request("a").row, pool.request("b").row]
        result = pool.retract(rows, offload=True, retract_decode_steps=1)
        assert result.retracted == ["b"] and not result.offload_failed
        assert result.offloaded_bytes == pool.host_store.used_bytes > 0
        assert pool.host_store.swa_from("b") == 4  # floor_page(16 - W)
        pool.check_integrity()
        write(pool, "a", 16, pool.alloc_decode(["a"]), salt=1)
        pool.release("a", is_insert=False)
        pool.open_request("b")
        assert pool.load("b") is not None
        full, swa = read(pool, "b", 4)
        assert full == [2000 + p for p in range(16)]
        assert swa == [-(2000 + p) for p in range(4, 16)]
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_full_host_store_changes_nothing() -> None:
    with pool_of(host_store_bytes=0) as pool:
        grow(pool, "a", 9, 0, salt=1)
        with pytest.raises(HostStoreFullError):
            pool.offload("a")
        assert len(pool.host_store) == 0 and pool.host_store.used_bytes == 0
        rows = [pool.open_request("b"), pool.request("a").row]
        result = pool.retract(rows, offload=True, retract_decode_steps=0)
        assert result.offload_failed == ["a"] and not result.retracted
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_pure_swa_pool_offloads_the_window_alone() -> None:
    with pool_of(layer_types=(S, S)) as pool:
        store = pool.host_store
        assert isinstance(store, HybridHostStore) and store.full.capacity_bytes == 0
        grow(pool, "a", 30, 3, salt=4)
        nbytes = pool.offload("a")
        assert store.swa_from("a") == 20 and nbytes == 4 * 2 * (2 * 2 * PS * 4)
        pool.release("a", is_insert=False)
        pool.open_request("a")
        slots = pool.load("a")
        assert slots is not None and slots.size == 33
        f2s = pool.buffers.full_to_swa_page
        tail = slots[20:]
        got = pool.buffers.swa_kv[f2s[tail // PS], :, 0, tail % PS, 0, 0]
        assert (got == -(4000 + np.arange(20, 33))[:, None]).all()
        pool.check_integrity()
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)


def test_host_bytes_split_as_the_device_pools() -> None:
    with pool_of() as pool:
        layout = pool.layout
        full, swa = split_host_bytes(layout, 1 << 20)
        assert full + swa == 1 << 20
        # 32 pages of 1 full layer against 12 pages of 2 SWA layers: 32 : 24
        assert abs(full / swa - 32 / 24) < 1e-3
