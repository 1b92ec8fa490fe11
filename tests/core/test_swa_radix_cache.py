"""The SWA radix cache and the hybrid pool's eviction, case by case (SGLang's rules)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from memsvc.core import KVPool, PoolLayout
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_radix_cache import SWARadixCache

F, S = "full_attention", "sliding_attention"
PS, W = 4, 8


def pool_of(num_pages: int = 16, swa_num_pages: int = 16) -> KVPool:
    layout = PoolLayout(
        num_layers=2,
        layer_types=(S, F),
        sliding_window=W,
        swa_num_pages=swa_num_pages,
        num_kv_heads=1,
        head_dim=2,
        page_size=PS,
        num_pages=num_pages,
        max_running_requests=4,
        max_context_len=64,
        dtype="float32",
    )
    return KVPool(layout)


def cache(pool: KVPool, rid: str, tokens: np.ndarray) -> None:
    """Compute ``tokens`` as one extend and hand them to the tree."""
    pool.open_request(rid)
    pool.alloc_extend([(rid, tokens.size)])
    pool.release(rid, tokens)


def tree_pages(pool: KVPool, tokens: np.ndarray) -> np.ndarray:
    match = pool.tree.match_prefix(tokens)  # (after a cut, the pages of the cut match)
    return match.slots[::PS] // PS


def test_a_match_ends_where_its_swa_tail_is_held() -> None:
    tokens = np.arange(1, 25)
    with pool_of() as pool:
        cache(pool, "w", tokens)
        pages = tree_pages(pool, tokens)
        assert pool.swa_evictable_size() == 24  # the extend's window kept every page
        # tombstone the page over positions [16, 20): a match to 24 needs [16, 24),
        # one to 20 needs [12, 20); one to 16 needs [8, 16), held
        pool.allocator.free_swa_pages(pages[4:5])
        pool.open_request("a")
        assert pool.match_prefix("a", np.append(tokens, 99)) == 16
        # the window of a: [8, 16), pinned; the rest of the tree's SWA is evictable
        assert pool.swa_protected_size() == 8 and pool.swa_evictable_size() == 12
        pool.check_integrity()
        # everything unpinned goes, the locked path's included; a's window stays
        assert pool.evict_swa(100) == 12
        assert pool.swa_evictable_size() == 0 and pool.evictable_size() == 8
        assert pool.allocator.full_to_swa_page[pages[2:4]].all()
        pool.check_integrity()
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)
        # a's window kept its pages' SWA KV: a match to 16 again, then nothing pins it
        pool.open_request("b")
        assert pool.match_prefix("b", np.append(tokens, 99)) == 16
        pool.release("b", is_insert=False)
        assert pool.evict_swa(100) == 8
        # no SWA tail is held anywhere now: every match is a miss, the full KV stays
        pool.open_request("b")
        assert pool.match_prefix("b", np.append(tokens, 99)) == 0
        # a match shorter than the window needs SWA from position 0 on: gone too
        assert pool.match_prefix("b", tokens[:5]) == 0
        pool.release("b", is_insert=False)
        assert pool.evictable_size() == 24
        pool.check_integrity(idle=True)


def test_swa_eviction_takes_least_recently_used_nodes_first() -> None:
    with pool_of() as pool:
        old, new = np.arange(1, 9), np.arange(100, 108)
        cache(pool, "old", old)
        cache(pool, "new", new)
        assert pool.evict_swa(4) == 4  # the oldest page of the oldest node
        assert pool.allocator.full_to_swa_page[tree_pages(pool, new)].all()
        assert pool.swa_evictable_size() == 12
        pool.check_integrity(idle=True)


def test_check_decode_mem_evicts_each_pools_shortfall_alone() -> None:
    """D15: for the SWA allocator, both shortfalls are evicted and both pools compared."""
    with pool_of(num_pages=8, swa_num_pages=4) as pool:
        cache(pool, "w", np.arange(1, 9))  # 2 pages of each pool in the tree
        pool.open_request("a")
        pool.alloc_extend([("a", 8)])  # 2 more pages each: the SWA pool is full
        assert pool.full_available_size() == 16 and pool.swa_available_size() == 0
        assert pool.available_size() == 0
        assert pool.check_decode_mem(["a"])  # needs a page of each: SWA is short by one
        # one SWA page tombstoned, the full pool untouched
        assert pool.swa_available_size() == PS and pool.evictable_size() == 8
        assert pool.swa_evictable_size() == 4
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)
    with pool_of(num_pages=4, swa_num_pages=16) as pool:
        cache(pool, "w", np.arange(1, 9))
        pool.open_request("a")
        pool.alloc_extend([("a", 8)])  # the full pool is full
        assert pool.check_decode_mem(["a"])
        # a full eviction of one leaf: its pages go from both pools
        assert pool.full_available_size() == 8 and pool.evictable_size() == 0
        assert pool.swa_available_size() == 64 - 8
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)
    with pool_of(num_pages=4, swa_num_pages=4) as pool:
        pool.open_request("a")
        pool.alloc_extend([("a", 16)])
        assert not pool.check_decode_mem(["a"])  # nothing to evict in either pool
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_tombstoned_prefix_takes_the_swa_pages_of_a_request_that_recomputed_it() -> None:
    tokens = np.arange(1, 17)
    with pool_of() as pool:
        cache(pool, "w", tokens)
        pages = tree_pages(pool, tokens)
        pool.evict_swa(100)
        assert not pool.allocator.full_to_swa_page[pages].any()
        # b misses, computes the same prompt, publishes it: its window's pages were
        # duplicates of the tree's tombstones, now the tree's SWA pages
        pool.open_request("b")
        assert pool.match_prefix("b", tokens) == 0
        pool.alloc_extend([("b", 17)])
        full_before = pool.full_available_size()
        assert pool.cache_unfinished("b", np.append(tokens, 5)) == 16
        assert pool.slots("b")[:16:PS].tolist() == (pages * PS).tolist()
        assert pool.allocator.full_to_swa_page[pages].all()
        assert pool.full_available_size() == full_before + 16  # b's duplicates, full KV only
        pool.check_integrity()
        pool.release("b", np.append(tokens, 5))
        pool.open_request("c")
        assert pool.match_prefix("c", np.append(tokens, 7)) == 16
        pool.release("c", is_insert=False)
        pool.check_integrity(idle=True)


def test_decode_frees_the_pages_that_left_every_window() -> None:
    with pool_of() as pool:
        pool.open_request("a")
        pool.alloc_extend([("a", 20)])
        row = pool.request("a").row
        held = []
        for _ in range(10):
            pool.alloc_decode(["a"])
            held.append(int(pool.swa.evicted_lens[row]))
            pool.check_integrity()
        # step k allocates position 20 + k; the step before it (query 19 + k, maybe still
        # running) reads from 19 + k - W + 1 on: freed up to floor_page(20 + k - W)
        # (the first step after the extend keeps the extend's whole window)
        assert held == [0, 12, 12, 12, 16, 16, 16, 16, 20, 20]
        assert pool.swa_available_size() == 64 - 32 + 20
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)


def test_retract_by_recompute_frees_both_pools() -> None:
    # (retract by offload: tests/core/test_swa_host_store.py)
    with pool_of(num_pages=8, swa_num_pages=4) as pool:
        rows = []
        for rid in ("a", "b"):
            rows.append(pool.open_request(rid))
            pool.alloc_extend([(rid, 8)])  # the SWA pool is full
        assert pool.swa_available_size() == 0
        result = pool.retract(rows, offload=False, retract_decode_steps=0)
        assert result.retracted == ["b"] and not result.last_does_not_fit
        assert pool.swa_available_size() == 8 and pool.full_available_size() == 24
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_decode_slot_handed_back_unwritten_leaves_the_step_before_covered() -> None:
    """Overlap schedule: step A (query 22) runs while step B's slot (23) is reserved; the
    publish hands B's slot back unwritten, and the step re-taking position 23 must not free
    what A, maybe still running, reads (positions from 22 - W + 1 = 15 on)."""
    with pool_of() as pool:
        pool.open_request("a")
        pool.alloc_extend([("a", 22)])
        row = pool.request("a").row
        pool.alloc_decode(["a"])  # A, position 22
        pool.alloc_decode(["a"])  # B, position 23, reserved ahead
        pool.cache_unfinished("a", np.arange(23))  # B's slot handed back
        assert pool.request("a").kv_len == 23
        pool.alloc_decode(["a"])  # position 23 again
        # A's frontier floor_page(22 + 1 - W) = 12, not B's floor_page(23 + 1 - W) = 16
        assert int(pool.swa.evicted_lens[row]) == 12
        slots = pool.slots("a")
        assert pool.allocator.full_to_swa_page[slots[15:] // PS].all()
        pool.check_integrity()
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)


@given(
    has_swa=st.lists(st.booleans(), max_size=24),
    page_size=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 20),
)
def test_the_valid_match_length_is_the_longest_end_whose_tail_holds_swa(
    has_swa: list[bool], page_size: int, window: int
) -> None:
    allocator = SWAPageAllocator(num_pages=24, swa_num_pages=24, page_size=page_size)
    tree = SWARadixCache(allocator, window)
    pages = np.arange(1, len(has_swa) + 1)
    allocator.full_to_swa_page[pages] = np.where(has_swa, pages, 0)
    slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)

    def tail_held(end: int) -> bool:  # end in pages; positions [end*ps - W, end*ps)
        first = max(0, end * page_size - window) // page_size
        return all(has_swa[first:end])

    want = max((end for end in range(len(has_swa) + 1) if tail_held(end)), default=0)
    assert tree.swa_valid_len(slots) == want * page_size


def test_an_allocation_may_use_the_swa_pages_it_frees() -> None:
    """One-page chunks on a 4-page SWA pool (W = 8): the chunk at 16 follows the one at 12,
    whose window starts at 5: the page of 0..3 is freed before the chunk at 16 is judged,
    so it fits (freed after it, as before, it never would: the pool holds 0..15)."""
    with pool_of(swa_num_pages=4) as pool:
        pool.open_request("a")
        row = pool.request("a").row
        for _ in range(4):
            assert pool.alloc_extend([("a", PS)]) is not None
        assert pool.swa_available_size() == 0
        for start in range(16, 40, PS):
            assert pool.alloc_extend([("a", PS)]) is not None, start
            # the window of the chunk before (start - PS) starts at start - PS + 1 - W
            assert int(pool.swa.evicted_lens[row]) == (start - PS + 1 - W) // PS * PS
            pool.check_integrity()
        # then decode: each step may use what it frees too
        for _ in range(6):
            assert pool.alloc_decode(["a"]) is not None
            pool.check_integrity()
        pool.release("a", is_insert=False)
        pool.check_integrity(idle=True)
