"""``--zero-freed-kv`` (issue 30, item 3): the pages that held a salted request's KV are zero
before any other request gets them; the default namespace's pages are left as they are.

Each test fills a salted request's pages with non-zero KV, releases it (into the tree),
evicts the tree, and reads the pages the next request is handed *before* it writes
anything: zero with the flag, the old KV without it (so the check can fail). Every
test ends with the pool's idle check.
"""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.layout import PoolLayout, hybrid_layout
from tests.core.test_hicache import PAGE, kv_of, kv_shape, layout, run_request, seq

SALTED = "5" * 32
OTHER = "6" * 32


def fill(pool: KVPool, rid: str, tokens: np.ndarray, namespace: str) -> np.ndarray:
    """Open ``rid``, give it KV for ``tokens`` (non-zero), release it into the tree."""
    pool.open_request(rid, namespace)
    slots = pool.alloc_extend([(rid, len(tokens))])
    assert slots is not None
    pool.buffers.write_slots(slots, kv_of(tokens, 0, kv_shape(pool)) + 1)
    pool.release(rid, tokens)
    return np.unique(slots // pool.page_size)


def handed(pool: KVPool, rid: str, num_tokens: int, namespace: str = "") -> np.ndarray:
    """Open ``rid`` and allocate ``num_tokens``; the KV its slots hold before any write."""
    pool.open_request(rid, namespace)
    slots = pool.alloc_extend([(rid, num_tokens)])
    assert slots is not None
    return slots, pool.buffers.read_slots(slots)


def finish(pool: KVPool) -> None:
    for rid in pool.open_rids():
        pool.release(rid, is_insert=False)
    pool.evict(pool.evictable_size())
    pool.settle_copies()
    pool.check_integrity(idle=True)
    pool.close()


@pytest.mark.parametrize("zero", [True, False])
def test_a_salted_requests_pages_are_zero_before_the_next_request_gets_them(zero):
    pool = KVPool(layout(num_pages=4), zero_freed_kv=zero)
    tokens = seq(1, 4, tail=0)
    pages = fill(pool, "salted", tokens, SALTED)
    assert pool.evictable_size() == 16  # in the tree, unlocked
    pool.evict(16)
    slots, kv = handed(pool, "next", 16)
    assert set(np.unique(slots // PAGE)) == set(pages)  # the very same pages
    if zero:
        assert not kv.any()
        assert pool.scrub.num_zeroed_pages == 4
    else:
        assert kv.all()  # what the salted request left: the check above can fail
    finish(pool)


def test_the_default_namespace_is_not_zeroed_and_a_page_is_zeroed_once():
    pool = KVPool(layout(num_pages=4), zero_freed_kv=True)
    fill(pool, "plain", seq(2, 4, tail=0), "")
    pool.evict(16)
    _, kv = handed(pool, "next", 16)
    assert kv.all() and pool.scrub.num_zeroed_pages == 0  # no cost for unsalted KV
    pool.release("next", is_insert=False)
    fill(pool, "salted", seq(3, 2, tail=0), OTHER)  # two pages tainted
    pool.evict(pool.evictable_size())
    _, kv = handed(pool, "again", 16)  # gets the two salted pages and two others
    assert pool.scrub.num_zeroed_pages == 2
    assert int((~kv.reshape(4, -1).any(axis=1)).sum()) == 2  # one zero page per salted one
    pool.release("again", is_insert=False)
    _, _ = handed(pool, "third", 16)  # clean now: nothing zeroed twice
    assert pool.scrub.num_zeroed_pages == 2
    finish(pool)


def test_decode_pages_and_matched_pages_of_a_salted_request_are_zeroed():
    pool = KVPool(layout(num_pages=6), zero_freed_kv=True)
    plain = seq(4, 2, tail=0)
    fill(pool, "plain", plain, "")  # 2 clean pages in the tree
    pool.open_request("s", SALTED)
    slots = pool.alloc_extend([("s", 7)])
    pool.buffers.write_slots(slots, kv_of(seq(5, 2)[:7], 0, kv_shape(pool)) + 1)
    new = pool.alloc_decode(["s"])  # position 7: same page; position 8 opens one
    pool.buffers.write_slots(new, np.ones((1, *kv_shape(pool)), np.float32))
    new = pool.alloc_decode(["s"])
    pool.buffers.write_slots(new, np.ones((1, *kv_shape(pool)), np.float32))
    pool.release("s", is_insert=False)
    assert pool.scrub.full.tainted.sum() == 3
    _, kv = handed(pool, "n", 4 * PAGE)  # the 3 salted pages and one more free
    assert not kv.any()
    pool.release("n", is_insert=False)
    finish(pool)


def test_hicache_loads_for_a_salted_request_are_zeroed_after_eviction(tmp_path):
    lay = layout(num_pages=4)
    from memsvc.core.hicache import HiCacheConfig

    pool = KVPool(lay, hicache=HiCacheConfig(size_bytes=8 * lay.bytes_per_page), zero_freed_kv=True)
    tokens = seq(6, 3)
    pool.open_request("w", SALTED)
    match = pool.match_prefix_tiers("w", tokens[:-1])
    slots = pool.alloc_extend([("w", len(tokens) - match.prefix_len)])
    pool.buffers.write_slots(slots, kv_of(tokens, 0, kv_shape(pool)) + 1)
    pool.release("w", tokens)
    pool.settle_copies()
    pool.evict(pool.evictable_size())  # host copy kept; device pages freed (tainted)
    pool.tree.settle()
    pool.scrub.full.tainted[:] = False  # forget them: the load below must taint its own
    pool.buffers.kv[1:] = 3  # and make every page dirty again
    pool.open_request("r", SALTED)
    match = pool.match_prefix_tiers("r", tokens[:-1])
    assert match.host_tokens == 12
    assert pool.wait_loaded("r") is None
    loaded = np.unique(pool.slots("r", 0, 12) // PAGE)
    assert pool.scrub.full.tainted[loaded].all()
    pool.release("r", is_insert=False)
    pool.evict(pool.evictable_size())
    slots, kv = handed(pool, "n", 16)
    was_loaded = np.isin(slots // PAGE, loaded)
    assert was_loaded.sum() == 12 and not kv[was_loaded].any()
    assert kv[~was_loaded].all()  # the page the load did not use: never salted, kept
    finish(pool)


def test_a_hybrid_pools_swa_pages_are_zeroed_too():
    base = PoolLayout(
        num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, num_pages=8,
        dtype="float32", max_running_requests=8, max_context_len=128,
    )  # fmt: skip
    lay = hybrid_layout(base, ("full_attention", "sliding_attention"), 8, 1.0)
    pool = KVPool(lay, zero_freed_kv=True)
    assert pool.scrub.swa is not None
    pool.open_request("s", SALTED)
    slots = pool.alloc_extend([("s", 8)])
    pages = np.unique(slots // PAGE)
    swa_pages = pool.allocator.full_to_swa_page[pages]
    pool.buffers.swa_kv[swa_pages] = 7
    pool.release("s", is_insert=False)
    pool.open_request("n")
    slots = pool.alloc_extend([("n", 8)])
    got = pool.allocator.full_to_swa_page[np.unique(slots // PAGE)]
    assert set(got) == set(swa_pages)
    assert not pool.buffers.swa_kv[got].any()
    assert pool.scrub.swa.num_zeroed_pages == 2
    finish(pool)


def test_run_request_still_works_with_the_flag():
    pool = KVPool(layout(), zero_freed_kv=True)
    run_request(pool, "a", seq(7, 3))
    run_request(pool, "b", seq(7, 3))
    finish(pool)


def test_host_copies_of_salted_kv_are_zeroed_when_freed():
    """The hierarchical cache's host tier (a salted node's host copy dropped) and the host
    store (a salted request's offloaded KV loaded back) leave no salted KV behind."""
    from memsvc.core.hicache import HiCacheConfig

    lay = layout(num_pages=4)
    pool = KVPool(
        lay,
        hicache=HiCacheConfig(size_bytes=8 * lay.bytes_per_page),
        host_store_bytes=8 * lay.bytes_per_page,
        zero_freed_kv=True,
    )
    plain, salted = seq(8, 2, tail=0), seq(9, 2, tail=0)
    fill(pool, "plain", plain, "")
    fill(pool, "salted", salted, SALTED)
    pool.settle_copies()  # write_through: both have host copies
    arena = pool.hicache.host.arena
    assert arena.reshape(8, -1).any(axis=1).sum() == 4
    pool.flush_cache()  # every host copy freed
    pool.settle_copies()
    rows = arena.reshape(8, -1).any(axis=1)
    assert rows.sum() == 2  # the plain copies' bytes stay (never salted), the salted are zero
    # the host store: offload a salted request, load it back
    pool.open_request("s2", SALTED)
    slots = pool.alloc_extend([("s2", 8)])
    pool.buffers.write_slots(slots, kv_of(salted, 0, kv_shape(pool)) + 1)
    pool.offload("s2")
    pool.release("s2", is_insert=False)
    store_arena = pool.host_store._arena
    assert store_arena.any()
    pool.open_request("s2", SALTED)
    assert pool.load("s2").size == 8
    assert not store_arena.any()  # loaded back: the host store's copy is zero
    np.testing.assert_array_equal(
        pool.buffers.read_slots(pool.slots("s2")), kv_of(salted, 0, kv_shape(pool)) + 1
    )
    pool.release("s2", is_insert=False)
    finish(pool)
