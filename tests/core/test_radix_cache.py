"""RadixCache on a real PageAllocator, at page sizes 1 and 16.

Every test ends with ``assert_integrity``: the tree's own check plus a page
count showing each page 1..num_pages in exactly one place (free list, a tree
node, or slots the test still holds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsvc.core.allocator import PageAllocator, ceil_div
from memsvc.core.errors import InvalidArgumentError, InvalidPageError
from memsvc.core.radix_cache import RadixCache, TreeNode

PAGE_SIZES = [1, 16]
NUM_PAGES = 64


# -- helpers -------------------------------------------------------------------


@pytest.fixture(params=PAGE_SIZES, ids=lambda ps: f"ps{ps}")
def ps(request: pytest.FixtureRequest) -> int:
    return request.param


def make_cache(page_size: int, num_pages: int = NUM_PAGES, disabled: bool = False) -> RadixCache:
    return RadixCache(PageAllocator(num_pages, page_size), disabled=disabled)


def toks(page_size: int, page_kinds: list[int], tail_len: int = 0) -> np.ndarray:
    """One page of token ids per kind, then ``tail_len`` unaligned tokens (all 9).

    Pages of different kinds differ only in their last token, so a mismatch
    lands inside a page and exercises the round-down to whole pages.
    """
    pages = [np.append(np.arange(page_size - 1), 1000 + kind) for kind in page_kinds]
    return np.concatenate([*pages, np.full(tail_len, 9)]).astype(np.int64)


def take(allocator: PageAllocator, num_tokens: int) -> np.ndarray:
    """Slots for ``num_tokens`` tokens on fresh whole pages (the last one maybe partly used)."""
    slots = allocator.alloc(ceil_div(num_tokens, allocator.page_size) * allocator.page_size)
    assert slots is not None, "test pool too small"
    return slots[:num_tokens]


def assert_integrity(cache: RadixCache, *held: np.ndarray, idle: bool = False) -> None:
    """Tree check, then every page in exactly one of: free list, tree node, ``held`` slots."""
    cache.check()
    allocator, page_size = cache.allocator, cache.page_size
    owners = np.zeros(allocator.num_pages + 1, dtype=np.int64)
    np.add.at(owners, np.asarray(allocator.free_page_list(), dtype=np.int64), 1)
    for node in cache.iter_nodes():
        np.add.at(owners, np.unique(node.value // page_size), 1)
    for slots in held:
        np.add.at(owners, np.unique(np.asarray(slots, dtype=np.int64) // page_size), 1)
    assert owners[0] == 0, "the padding page 0 is in use"
    misplaced = np.flatnonzero(owners[1:] != 1) + 1
    assert misplaced.size == 0, f"pages {misplaced[:8]} have {owners[misplaced[:8]]} owners"
    if idle:
        assert cache.protected_size() == 0
        assert allocator.available_size() + cache.evictable_size() == allocator.capacity


def snapshot(cache: RadixCache) -> tuple:
    nodes = sorted(
        (
            n.node_id,
            n.key.tolist(),
            n.value.tolist(),
            n.lock_ref,
            n.last_access_time,
            n.parent.node_id,
        )
        for n in cache.iter_nodes()
    )
    sizes = (cache.evictable_size(), cache.protected_size(), cache.total_size())
    return sizes, cache.allocator.free_page_list(), nodes


def pages_in_use(cache: RadixCache, slots: np.ndarray) -> bool:
    """Whether all pages of ``slots`` are allocated (reads no access time, unlike a match)."""
    return bool(cache.allocator.is_in_use(slots // cache.page_size).all())


# -- insert and match ----------------------------------------------------------


def test_insert_then_match_returns_inserted_slots(ps: int) -> None:
    cache = make_cache(ps)
    tokens = toks(ps, [0, 1, 2])
    slots = take(cache.allocator, 3 * ps)
    caller_tokens, caller_slots = tokens.copy(), slots.copy()
    assert cache.insert(caller_tokens, caller_slots) == 0
    caller_tokens[:] = -1  # the tree must hold copies, not the caller's arrays
    caller_slots[:] = 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (
        3 * ps,
        0,
        3 * ps,
    )

    match = cache.match_prefix(tokens)
    np.testing.assert_array_equal(match.slots, slots)
    np.testing.assert_array_equal(match.last_node.key, tokens)
    assert match.last_node.parent is cache.root

    longer = cache.match_prefix(np.append(tokens, toks(ps, [3, 4], ps // 2)))
    np.testing.assert_array_equal(longer.slots, slots)
    assert longer.last_node is match.last_node

    miss = cache.match_prefix(toks(ps, [5, 0]))
    assert miss.slots.size == 0 and miss.slots.dtype == np.int64
    assert miss.last_node is cache.root
    assert len(list(cache.iter_nodes())) == 1
    assert_integrity(cache, idle=True)


def test_match_rounds_down_to_whole_pages(ps: int) -> None:
    cache = make_cache(ps)
    tokens = toks(ps, [0, 1])
    slots = take(cache.allocator, 2 * ps)
    cache.insert(tokens, slots)

    assert len(cache.match_prefix(tokens[: ps - 1]).slots) == 0  # less than a page
    match = cache.match_prefix(tokens[: 2 * ps - 1])  # ends inside the second page
    np.testing.assert_array_equal(match.slots, slots[:ps])
    # Mismatch on the last token of page 2: only page 1 counts.
    np.testing.assert_array_equal(cache.match_prefix(toks(ps, [0, 2])).slots, slots[:ps])
    assert len(cache.match_prefix(np.append(tokens, toks(ps, [], ps // 2))).slots) == 2 * ps
    assert cache.total_size() == cache.evictable_size() == 2 * ps
    assert_integrity(cache, idle=True)


def test_partial_match_splits_node_at_page_boundary(ps: int) -> None:
    cache = make_cache(ps)
    tokens = toks(ps, [0, 1, 2, 3])
    slots = take(cache.allocator, 4 * ps)
    cache.insert(tokens, slots)
    leaf = cache.match_prefix(tokens).last_node

    match = cache.match_prefix(toks(ps, [0, 1, 5]))
    np.testing.assert_array_equal(match.slots, slots[: 2 * ps])
    upper = match.last_node
    assert upper is not leaf and upper.parent is cache.root
    np.testing.assert_array_equal(upper.key, tokens[: 2 * ps])
    np.testing.assert_array_equal(upper.value, slots[: 2 * ps])
    # The original node keeps the lower half, so holders of it still end at token 4*ps.
    assert list(upper.children.values()) == [leaf] and leaf.parent is upper
    np.testing.assert_array_equal(leaf.key, tokens[2 * ps :])
    np.testing.assert_array_equal(leaf.value, slots[2 * ps :])
    assert (cache.evictable_size(), cache.total_size()) == (4 * ps, 4 * ps)

    full = cache.match_prefix(tokens)
    assert full.last_node is leaf
    np.testing.assert_array_equal(full.slots, slots)
    assert len(list(cache.iter_nodes())) == 2
    assert_integrity(cache, idle=True)


def test_split_of_locked_node_keeps_lock_accounting(ps: int) -> None:
    cache = make_cache(ps)
    tokens = toks(ps, [0, 1, 2])
    cache.insert(tokens, take(cache.allocator, 3 * ps))
    leaf = cache.match_prefix(tokens).last_node
    cache.lock(leaf)
    upper = cache.match_prefix(tokens[:ps]).last_node  # splits the locked node
    assert (upper.lock_ref, leaf.lock_ref) == (1, 1)
    assert (cache.protected_size(), cache.evictable_size()) == (3 * ps, 0)
    assert_integrity(cache)
    cache.unlock(leaf)
    assert (upper.lock_ref, cache.protected_size(), cache.evictable_size()) == (0, 0, 3 * ps)
    assert_integrity(cache, idle=True)


def test_insert_returns_already_present_len_and_frees_nothing(ps: int) -> None:
    cache = make_cache(ps)
    allocator = cache.allocator
    first = take(allocator, 3 * ps)
    assert cache.insert(toks(ps, [0, 1, 2]), first) == 0

    second = take(allocator, 4 * ps)
    free_before = allocator.available_size()
    assert cache.insert(toks(ps, [0, 1, 7, 8]), second) == 2 * ps
    assert allocator.available_size() == free_before  # the duplicates are the caller's to free
    allocator.free(second[: 2 * ps])
    assert cache.evictable_size() == 5 * ps
    np.testing.assert_array_equal(
        cache.match_prefix(toks(ps, [0, 1, 7, 8])).slots,
        np.concatenate([first[: 2 * ps], second[2 * ps :]]),
    )

    covered = take(allocator, 2 * ps)
    assert cache.insert(toks(ps, [0, 1]), covered) == 2 * ps
    allocator.free(covered)
    assert cache.total_size() == 5 * ps

    # Only the page-aligned part goes in; the unaligned tail stays the caller's.
    tail_len = ps // 2
    unaligned = take(allocator, ps + tail_len)
    assert cache.insert(toks(ps, [9], tail_len), unaligned) == 0
    assert cache.total_size() == 6 * ps
    assert_integrity(cache, unaligned[ps:])
    allocator.free(unaligned[ps:])
    assert_integrity(cache, idle=True)


# -- locks ---------------------------------------------------------------------


def test_lock_unlock_moves_tokens_between_evictable_and_protected(ps: int) -> None:
    cache = make_cache(ps)
    cache.insert(toks(ps, [0, 1]), take(cache.allocator, 2 * ps))
    deeper = take(cache.allocator, 3 * ps)
    cache.insert(toks(ps, [0, 1, 2]), deeper)
    cache.allocator.free(deeper[: 2 * ps])
    cache.insert(toks(ps, [5]), take(cache.allocator, ps))
    leaf = cache.match_prefix(toks(ps, [0, 1, 2])).last_node
    inner = leaf.parent
    assert len(inner.key) == 2 * ps

    def state() -> tuple[int, int, int, int]:
        return cache.evictable_size(), cache.protected_size(), inner.lock_ref, leaf.lock_ref

    cache.lock(leaf)
    assert state() == (ps, 3 * ps, 1, 1)
    cache.lock(inner)
    assert state() == (ps, 3 * ps, 2, 1)
    cache.lock(leaf)
    assert state() == (ps, 3 * ps, 3, 2)
    cache.unlock(leaf)
    assert state() == (ps, 3 * ps, 2, 1)
    cache.unlock(leaf)
    assert state() == (2 * ps, 2 * ps, 1, 0)
    assert_integrity(cache)

    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError):
        cache.unlock(leaf)
    assert snapshot(cache) == before
    cache.unlock(inner)
    assert state() == (4 * ps, 0, 0, 0)
    with pytest.raises(InvalidArgumentError):
        cache.unlock(inner)

    cache.lock(cache.root)
    cache.unlock(cache.root)
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 1
    assert state() == (4 * ps, 0, 0, 0)
    assert_integrity(cache, idle=True)


# -- eviction ------------------------------------------------------------------


def test_evict_takes_least_recently_used_leaf_first(ps: int) -> None:
    cache = make_cache(ps)
    slots = {}
    for name, kinds in (("x", [0, 1]), ("y", [2, 3]), ("z", [4, 5])):
        slots[name] = take(cache.allocator, 2 * ps)
        cache.insert(toks(ps, kinds), slots[name])
    cache.match_prefix(toks(ps, [0, 1]))  # x is now the most recent

    assert cache.evict(1) == 2 * ps  # a whole leaf goes, even for one token
    assert [pages_in_use(cache, slots[n]) for n in "xyz"] == [True, False, True]
    assert cache.evict(1) == 2 * ps
    assert [pages_in_use(cache, slots[n]) for n in "xyz"] == [True, False, False]
    assert cache.evict(10**6) == 2 * ps  # everything evictable, not more
    assert cache.total_size() == 0
    assert cache.allocator.available_size() == cache.allocator.capacity
    assert_integrity(cache, idle=True)


def test_evict_pushes_parent_once_it_becomes_a_leaf(ps: int) -> None:
    cache = make_cache(ps)
    allocator = cache.allocator
    first = take(allocator, 2 * ps)
    cache.insert(toks(ps, [0, 1]), first)  # parent [0] + child [1]
    second = take(allocator, 2 * ps)
    assert cache.insert(toks(ps, [0, 2]), second) == ps  # second child [2]
    allocator.free(second[:ps])
    newest = take(allocator, ps)
    cache.insert(toks(ps, [3]), newest)
    parent_slots, children_slots = first[:ps], np.concatenate([first[ps:], second[ps:]])

    # One call: both children go, then the parent, now a leaf last touched before
    # [3] was inserted, goes before [3].
    assert cache.evict(3 * ps) == 3 * ps
    assert not pages_in_use(cache, children_slots) and not pages_in_use(cache, parent_slots)
    assert pages_in_use(cache, newest)
    np.testing.assert_array_equal(cache.match_prefix(toks(ps, [3])).slots, newest)
    assert cache.match_prefix(toks(ps, [0])).last_node is cache.root
    assert_integrity(cache, idle=True)


def test_evict_never_frees_locked_nodes(ps: int) -> None:
    cache = make_cache(ps)
    locked_slots = take(cache.allocator, 2 * ps)
    cache.insert(toks(ps, [0, 1]), locked_slots)
    cache.insert(toks(ps, [2]), take(cache.allocator, ps))
    locked = cache.match_prefix(toks(ps, [0, 1])).last_node
    cache.lock(locked)

    assert cache.evict(10**6) == ps
    assert cache.evict(10**6) == 0
    assert (cache.protected_size(), cache.evictable_size()) == (2 * ps, 0)
    np.testing.assert_array_equal(cache.match_prefix(toks(ps, [0, 1])).slots, locked_slots)
    assert_integrity(cache)
    cache.unlock(locked)
    assert cache.evict(10**6) == 2 * ps
    with pytest.raises(InvalidArgumentError):
        cache.lock(locked)  # evicted nodes are detached
    assert_integrity(cache, idle=True)


def test_split_stamps_both_halves_as_just_used() -> None:
    """Issue 19, item 1 (SGLang's reproducer at page size 1, 78 pages).

    A match that ends inside a node visits that node: SGLang stamps it before
    splitting, so the lower half it keeps is as fresh as the upper one. Here
    the stale lower half [681, 748] used to go first, then [10, 440, 524, 538]:
    6 tokens evicted where SGLang evicts only the older 4-token leaf.
    """
    cache = make_cache(1, num_pages=78)
    served = {}
    for prompt in ([742, 681, 748], [10, 440, 524, 538], [742]):
        req = start_request(cache, np.array(prompt))
        cache.cache_finished_req(
            req.tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=True
        )
        served[tuple(prompt)] = req.kv_slots
    assert cache.evict(4) == 4
    assert not pages_in_use(cache, served[(10, 440, 524, 538)])
    assert pages_in_use(cache, served[(742, 681, 748)])
    assert_integrity(cache, idle=True)


def test_evict_zero_and_negative(ps: int) -> None:
    cache = make_cache(ps)
    cache.insert(toks(ps, [0]), take(cache.allocator, ps))
    before = snapshot(cache)
    assert cache.evict(0) == 0
    with pytest.raises(InvalidArgumentError):
        cache.evict(-1)
    assert snapshot(cache) == before
    assert_integrity(cache, idle=True)


# -- requests handing back their KV --------------------------------------------


@dataclass
class Running:
    tokens: np.ndarray
    kv_slots: np.ndarray
    protected_len: int
    last_node: TreeNode

    @property
    def own_slots(self) -> np.ndarray:
        return self.kv_slots[self.protected_len :]


def start_request(cache: RadixCache, tokens: np.ndarray) -> Running:
    """Match, lock the prefix and allocate the rest, as the scheduler would."""
    match = cache.match_prefix(tokens)
    cache.lock(match.last_node)
    own = take(cache.allocator, len(tokens) - len(match.slots))
    return Running(tokens, np.concatenate([match.slots, own]), len(match.slots), match.last_node)


def test_cache_finished_req_inserts_and_frees_duplicates_and_tail(ps: int) -> None:
    cache = make_cache(ps)
    allocator = cache.allocator
    prefix_slots = take(allocator, 2 * ps)
    cache.insert(toks(ps, [0, 1]), prefix_slots)
    tail_len = ps // 2
    req = start_request(cache, toks(ps, [0, 1, 2, 3], tail_len))
    assert req.protected_len == 2 * ps
    # Meanwhile another request caches page [2] too: req's copy becomes a duplicate.
    other = take(allocator, 3 * ps)
    assert cache.insert(toks(ps, [0, 1, 2]), other) == 2 * ps
    allocator.free(other[: 2 * ps])
    assert_integrity(cache, req.own_slots)

    free_before = allocator.available_size()
    cache.cache_finished_req(
        req.tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=True
    )
    freed_pages = 1 + (1 if tail_len else 0)  # the duplicate page and the tail page
    assert allocator.available_size() == free_before + freed_pages * ps
    assert (cache.total_size(), cache.protected_size()) == (4 * ps, 0)
    np.testing.assert_array_equal(
        cache.match_prefix(toks(ps, [0, 1, 2, 3])).slots,
        np.concatenate([prefix_slots, other[2 * ps :], req.kv_slots[3 * ps : 4 * ps]]),
    )
    assert_integrity(cache, idle=True)


def test_cache_finished_req_retract_inserts_nothing_and_unlocks_prefix(ps: int) -> None:
    cache = make_cache(ps)
    allocator = cache.allocator
    prefix_slots = take(allocator, 2 * ps)
    cache.insert(toks(ps, [0, 1]), prefix_slots)
    tail_len = ps // 2
    req = start_request(cache, toks(ps, [0, 1, 2, 3], tail_len))
    assert (req.last_node.lock_ref, cache.protected_size()) == (1, 2 * ps)
    assert_integrity(cache, req.own_slots)

    free_before = allocator.available_size()
    cache.cache_finished_req(
        req.tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=False
    )
    own_pages = 2 + (1 if tail_len else 0)
    assert allocator.available_size() == free_before + own_pages * ps
    assert (cache.total_size(), cache.evictable_size(), req.last_node.lock_ref) == (
        2 * ps,
        2 * ps,
        0,
    )
    retried = cache.match_prefix(req.tokens)
    np.testing.assert_array_equal(retried.slots, prefix_slots)
    assert retried.last_node is req.last_node
    assert_integrity(cache, idle=True)


def test_cache_finished_req_retract_with_nothing_cached_frees_everything(ps: int) -> None:
    cache = make_cache(ps)
    req = start_request(cache, toks(ps, [0, 1], ps // 2))
    assert req.last_node is cache.root and req.protected_len == 0
    cache.cache_finished_req(req.tokens, req.kv_slots, 0, cache.root, is_insert=False)
    assert cache.total_size() == 0
    assert cache.allocator.available_size() == cache.allocator.capacity
    assert_integrity(cache, idle=True)


def test_cache_unfinished_req_rewrites_slots_and_moves_lock(ps: int) -> None:
    cache = make_cache(ps)
    allocator = cache.allocator
    prefix_slots = take(allocator, 2 * ps)
    cache.insert(toks(ps, [0, 1]), prefix_slots)
    tail_len = ps // 2
    req = start_request(cache, toks(ps, [0, 1, 2, 3], tail_len))
    old_node = req.last_node
    other = take(allocator, 3 * ps)
    cache.insert(toks(ps, [0, 1, 2]), other)
    allocator.free(other[: 2 * ps])

    free_before = allocator.available_size()
    cached = cache.cache_unfinished_req(req.tokens, req.kv_slots, req.protected_len, old_node)
    own_tail = req.kv_slots[4 * ps :]
    expected = np.concatenate(
        [prefix_slots, other[2 * ps :], req.kv_slots[3 * ps : 4 * ps], own_tail]
    )
    np.testing.assert_array_equal(cached.slots, expected)
    assert cached.protected_len == 4 * ps
    np.testing.assert_array_equal(cached.last_node.key, toks(ps, [3]))
    assert (cached.last_node.lock_ref, old_node.lock_ref) == (1, 1)
    assert (cache.protected_size(), cache.evictable_size()) == (4 * ps, 0)
    assert allocator.available_size() == free_before + ps  # req's copy of page [2]
    assert_integrity(cache, own_tail)

    cache.cache_finished_req(
        req.tokens, cached.slots, cached.protected_len, cached.last_node, is_insert=True
    )
    assert cache.total_size() == 4 * ps
    assert_integrity(cache, idle=True)


def test_cache_unfinished_req_shorter_than_a_page_changes_nothing(ps: int) -> None:
    cache = make_cache(ps)
    cache.insert(toks(ps, [5]), take(cache.allocator, ps))
    req = start_request(cache, np.arange(ps - 1))
    before = snapshot(cache)
    cached = cache.cache_unfinished_req(req.tokens, req.kv_slots, 0, cache.root)
    np.testing.assert_array_equal(cached.slots, req.kv_slots)
    assert (cached.protected_len, cached.last_node) == (0, cache.root)
    assert snapshot(cache) == before
    assert_integrity(cache, req.kv_slots)
    cache.cache_finished_req(req.tokens, req.kv_slots, 0, cache.root, is_insert=True)
    assert_integrity(cache, idle=True)


def test_hand_back_with_tokens_other_than_the_locked_path_is_refused(ps: int) -> None:
    """Issue 18, defect 1: the tokens of the protected prefix must be the locked path's.

    Otherwise the tree re-inserts slots it already owns under other tokens (a page
    in two nodes), and a later eviction hands a locked page to someone else.
    """
    cache = make_cache(ps)
    allocator = cache.allocator
    cache.insert(toks(ps, [0, 1, 2, 3]), take(allocator, 4 * ps))
    victim = start_request(cache, toks(ps, [0, 1], 1))
    assert victim.protected_len == 2 * ps
    req = start_request(cache, toks(ps, [0, 1, 2, 3]))
    assert req.protected_len == 4 * ps
    forged = np.arange(100, 100 + len(req.tokens), dtype=np.int64)
    half_forged = np.concatenate([toks(ps, [0, 7]), toks(ps, [2, 3])])
    before = snapshot(cache)
    for tokens in (forged, half_forged):
        with pytest.raises(InvalidArgumentError, match="locked prefix"):
            cache.cache_finished_req(
                tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=True
            )
        assert snapshot(cache) == before
        with pytest.raises(InvalidArgumentError, match="locked prefix"):
            cache.cache_unfinished_req(tokens, req.kv_slots, req.protected_len, req.last_node)
        assert snapshot(cache) == before
    assert_integrity(cache, victim.own_slots)
    cache.cache_finished_req(
        req.tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=True
    )
    cache.cache_finished_req(
        victim.tokens, victim.kv_slots, victim.protected_len, victim.last_node, is_insert=False
    )
    assert_integrity(cache, idle=True)


# -- disabled mode -------------------------------------------------------------


def test_disabled_cache_caches_nothing(ps: int) -> None:
    cache = make_cache(ps, disabled=True)
    allocator = cache.allocator
    tokens = toks(ps, [0, 1], ps // 2)
    slots = take(allocator, len(tokens))
    assert cache.insert(tokens, slots) == 0
    match = cache.match_prefix(tokens)
    assert match.slots.size == 0 and match.last_node is cache.root
    cached = cache.cache_unfinished_req(tokens, slots, 0, cache.root)
    np.testing.assert_array_equal(cached.slots, slots)
    assert (cached.protected_len, cached.last_node) == (0, cache.root)
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert_integrity(cache, slots)

    cache.cache_finished_req(tokens, slots, 0, cache.root, is_insert=True)
    assert allocator.available_size() == allocator.capacity
    assert cache.evict(5) == 0
    assert list(cache.iter_nodes()) == []
    assert_integrity(cache, idle=True)


# -- bad input -----------------------------------------------------------------


def test_bad_input_raises_and_changes_nothing(ps: int) -> None:
    cache = make_cache(ps)
    allocator = cache.allocator
    tokens = toks(ps, [0, 1])
    cache.insert(tokens, take(allocator, 2 * ps))
    deeper = take(allocator, 3 * ps)
    assert cache.insert(toks(ps, [0, 1, 2]), deeper) == 2 * ps
    allocator.free(deeper[: 2 * ps])
    req = start_request(cache, toks(ps, [0, 1, 3], ps // 2))
    unlocked = cache.match_prefix(toks(ps, [0, 1, 2])).last_node
    fresh = take(allocator, 2 * ps)
    evicted = TreeNode(tokens, fresh, None, node_id=-1)
    reversed_page = fresh.copy()
    reversed_page[:ps] = reversed_page[:ps][::-1]
    out_of_pool = fresh.copy()
    out_of_pool[-1] = (NUM_PAGES + 1) * ps

    def finish(tokens=req.tokens, kv=req.kv_slots, protected=req.protected_len, node=req.last_node):
        return lambda: cache.cache_finished_req(tokens, kv, protected, node, is_insert=True)

    bad_calls = {
        "2-D tokens": lambda: cache.insert(tokens.reshape(1, -1), fresh),
        "float tokens": lambda: cache.insert(tokens.astype(float), fresh),
        "ragged tokens": lambda: cache.match_prefix([[1, 2], [3]]),
        "scalar tokens": lambda: cache.match_prefix(5),
        "too few slots": lambda: cache.insert(tokens, fresh[:-1]),
        "slot on page 0": lambda: cache.insert(tokens, np.zeros(2 * ps, np.int64)),
        "slot past the pool": lambda: cache.insert(tokens, out_of_pool),
        "kv/token length mismatch": finish(kv=req.kv_slots[:-1]),
        "negative protected_len": finish(protected=-ps),
        "protected_len past keys": finish(protected=len(req.tokens) + ps),
        "protected_len not at last_node": finish(protected=0),
        "last_node not locked": finish(protected=3 * ps, node=unlocked),
        "unlock unlocked": lambda: cache.unlock(unlocked),
        "lock detached": lambda: cache.lock(evicted),
        "evict negative": lambda: cache.evict(-1),
    }
    if ps > 1:
        bad_calls["slots not whole pages"] = lambda: cache.insert(tokens, reversed_page)
        bad_calls["protected_len mid-page"] = finish(protected=ps // 2)
        bad_calls["unfinished, kv not whole pages"] = lambda: cache.cache_unfinished_req(
            req.tokens,
            np.concatenate([req.kv_slots[: 2 * ps], reversed_page[:ps], req.own_slots[ps:]]),
            req.protected_len,
            req.last_node,
        )
    before = snapshot(cache)
    for name, call in bad_calls.items():
        with pytest.raises(InvalidArgumentError):
            call()
        assert snapshot(cache) == before, name
    with pytest.raises(InvalidPageError):
        cache.insert(tokens, out_of_pool)
    assert_integrity(cache, req.own_slots, fresh)
    allocator.free(fresh)
    cache.cache_finished_req(
        req.tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=False
    )
    assert_integrity(cache, idle=True)


def test_check_catches_corrupted_counters(ps: int) -> None:
    cache = make_cache(ps)
    cache.insert(toks(ps, [0]), take(cache.allocator, ps))
    cache._num_evictable_tokens += 1
    with pytest.raises(AssertionError, match="counters"):
        cache.check()
    cache._num_evictable_tokens -= 1
    leaf = cache.match_prefix(toks(ps, [0])).last_node
    good_value = leaf.value
    leaf.value = good_value[:-1]
    with pytest.raises(AssertionError, match="lengths"):
        cache.check()
    leaf.value = good_value
    leaf.lock_ref = -1
    with pytest.raises(AssertionError, match="lock_ref"):
        cache.check()
    leaf.lock_ref = 0
    assert_integrity(cache, idle=True)


# -- random operations ---------------------------------------------------------


class PrefixModel:
    """What the tree should hold: each cached page-aligned prefix -> the slots of its last page."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[bytes, np.ndarray] = {}

    def _prefix(self, keys: np.ndarray, page: int) -> bytes:
        return keys[: (page + 1) * self.page_size].tobytes()

    def match(self, tokens: np.ndarray) -> np.ndarray:
        found = []
        for page in range(len(tokens) // self.page_size):
            page_slots = self.pages.get(self._prefix(tokens, page))
            if page_slots is None:
                break
            found.append(page_slots)
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> int:
        present = len(self.match(tokens))
        for page in range(present // self.page_size, len(tokens) // self.page_size):
            start = page * self.page_size
            self.pages[self._prefix(tokens, page)] = slots[start : start + self.page_size].copy()
        return present

    def drop_freed(self, allocator: PageAllocator) -> int:
        """Forget prefixes whose page went back to the allocator; return tokens dropped."""
        freed = [
            prefix
            for prefix, page_slots in self.pages.items()
            if not allocator.is_in_use(page_slots[0] // self.page_size)
        ]
        for prefix in freed:
            del self.pages[prefix]
        return len(freed) * self.page_size


def draw_tokens(data: st.DataObject, page_size: int) -> np.ndarray:
    kinds = data.draw(st.lists(st.integers(0, 2), max_size=5), label="page kinds")
    tail_len = data.draw(st.integers(0, page_size - 1), label="tail")
    return toks(page_size, kinds, tail_len)


OPERATIONS = ["start", "finish", "publish", "insert", "match", "lock", "unlock", "evict"]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operations_keep_tree_model_and_pages_consistent(
    page_size: int, data: st.DataObject
) -> None:
    ps = page_size
    cache = make_cache(ps, num_pages=24)
    allocator = cache.allocator
    model = PrefixModel(ps)
    running: list[Running] = []
    extra_locks: list[TreeNode] = []

    def evict(num_tokens: int) -> int:
        evictable = cache.evictable_size()
        evicted = cache.evict(num_tokens)
        assert min(num_tokens, evictable) <= evicted <= evictable
        assert model.drop_freed(allocator) == evicted
        return evicted

    def hand_back(req: Running, is_insert: bool) -> None:
        keys = req.tokens[: len(req.tokens) - len(req.tokens) % ps]
        if is_insert:
            model.insert(keys, req.kv_slots)
        cache.cache_finished_req(
            req.tokens, req.kv_slots, req.protected_len, req.last_node, is_insert=is_insert
        )

    for _ in range(data.draw(st.integers(0, 30), label="steps")):
        operation = data.draw(st.sampled_from(OPERATIONS), label="operation")
        if operation in ("start", "match", "lock"):
            tokens = draw_tokens(data, ps)
            match = cache.match_prefix(tokens)
            np.testing.assert_array_equal(match.slots, model.match(tokens))
            if operation == "lock":
                cache.lock(match.last_node)
                extra_locks.append(match.last_node)
            elif operation == "start":
                cache.lock(match.last_node)
                need = ceil_div(len(tokens) - len(match.slots), ps) * ps
                if allocator.available_size() < need:
                    evict(need - allocator.available_size())
                own = allocator.alloc(need)
                if own is None:
                    cache.unlock(match.last_node)
                else:
                    own = own[: len(tokens) - len(match.slots)]
                    kv_slots = np.concatenate([match.slots, own])
                    running.append(Running(tokens, kv_slots, len(match.slots), match.last_node))
        elif operation == "finish" and running:
            req = running.pop(data.draw(st.integers(0, len(running) - 1), label="request"))
            hand_back(req, data.draw(st.booleans(), label="is_insert"))
        elif operation == "publish" and running:
            req = running[data.draw(st.integers(0, len(running) - 1), label="request")]
            keys = req.tokens[: len(req.tokens) - len(req.tokens) % ps]
            model.insert(keys, req.kv_slots)
            cached = cache.cache_unfinished_req(
                req.tokens, req.kv_slots, req.protected_len, req.last_node
            )
            np.testing.assert_array_equal(cached.slots[: len(keys)], model.match(keys))
            np.testing.assert_array_equal(cached.slots[len(keys) :], req.kv_slots[len(keys) :])
            req.kv_slots, req.protected_len = cached.slots, cached.protected_len
            req.last_node = cached.last_node
        elif operation == "insert":
            tokens = draw_tokens(data, ps)
            keys = tokens[: len(tokens) - len(tokens) % ps]
            slots = allocator.alloc(len(keys))
            if slots is not None:
                present = model.insert(keys, slots)
                assert cache.insert(tokens, slots) == present
                allocator.free(slots[:present])
        elif operation == "unlock" and extra_locks:
            cache.unlock(extra_locks.pop())
        elif operation == "evict":
            evict(data.draw(st.integers(0, 8 * ps), label="evict tokens"))

        for req in running:  # a locked prefix is never evicted
            protected = req.tokens[: req.protected_len]
            np.testing.assert_array_equal(model.match(protected), req.kv_slots[: req.protected_len])
        assert cache.total_size() == len(model.pages) * ps
        assert_integrity(cache, *(req.own_slots for req in running))

    for node in extra_locks:
        cache.unlock(node)
    for req in running:
        hand_back(req, data.draw(st.booleans(), label="is_insert at the end"))
    assert_integrity(cache, idle=True)
    evict(allocator.capacity)
    assert cache.total_size() == 0 and not model.pages
    assert allocator.available_size() == allocator.capacity
    assert_integrity(cache, idle=True)
