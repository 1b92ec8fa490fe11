"""Eviction from the kept heaps (memsvc/core/evict_heap.py) against the full walk it replaced.

The reference caches below are the eviction code as it was before issue 28:
every call built a fresh heap of every candidate by walking the whole tree.
The same random operations run on a cache and on its reference; after every
step the trees must be identical (node ids, keys, slots, host pages, storage
copies, locks, access times) and so must the free lists, so every eviction
took the same nodes in the same order (with the heaps compacted every few pushes,
as a large tree's are). Then: an eviction never walks the tree.
"""

from __future__ import annotations

import heapq
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsvc.core import KVPool, evict_heap
from memsvc.core.errors import IntegrityError
from memsvc.core.hicache import HiRadixCache
from memsvc.core.radix_cache import RadixCache
from tests.core.test_hicache import PAGE, make_pool
from tests.core.test_radix_cache import assert_integrity, make_cache, toks


@pytest.fixture(autouse=True)
def compact_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compact a heap once it passes 8 entries: small trees go through it too."""
    monkeypatch.setattr(evict_heap, "_MIN_COMPACT", 8)


# -- the full-walk references ----------------------------------------------------------


class FullWalkRadixCache(RadixCache):
    def evict(self, num_tokens: int) -> int:
        if num_tokens == 0:
            return 0
        leaves = [n for n in self.iter_nodes() if self._is_free_leaf(n)]
        heap = [(leaf.last_access_time, leaf.node_id, leaf) for leaf in leaves]
        heapq.heapify(heap)
        num_evicted, freed_values = 0, []
        while num_evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key)]
            leaf.parent = None
            freed_values.append(leaf.value)
            num_evicted += len(leaf.key)
            if self._is_free_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        self._num_evictable_tokens -= num_evicted
        if freed_values:
            self.allocator.free(np.concatenate(freed_values))
        return num_evicted


class FullWalkHiRadixCache(HiRadixCache):
    def _evict_device(self, num_tokens: int, protect: set[int]) -> int:
        heap = [
            (n.last_access_time, n.node_id, n) for n in self.iter_nodes() if self._is_device_leaf(n)
        ]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if self._load_state(node) == "failed":
                self.split_failed(node)
            parent = node.parent
            evicted += len(node.key)
            self._evict_device_node(node, protect)
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        return evicted

    def _evict_host(self, num_pages: int, protect: set[int]) -> None:
        heap = [
            (bool(n.value.size), n.last_access_time, n.node_id, n)
            for n in self.iter_nodes()
            if id(n) not in protect and self._host_evictable(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            *_, node = heapq.heappop(heap)
            if node.parent is None or not self._host_evictable(node):
                continue
            pages = node.host_pages
            if node.on_disk:
                self._free_host(node)
            elif self.storage is not None and self._demote(node, protect):
                pass
            elif node.value.size:
                self._free_host(node)
            elif not node.children:
                parent = node.parent
                self._drop_subtree(node)
                if id(parent) not in protect and self._host_evictable(parent):
                    heapq.heappush(
                        heap,
                        (bool(parent.value.size), parent.last_access_time, parent.node_id, parent),
                    )
            else:
                continue
            freed += pages.size

    def _storage_reserve(self, num_pages: int, protect: set[int]) -> bool:
        room = self.storage_capacity_pages - len(self._storage_keys)
        if num_pages > self.storage_capacity_pages:
            return False
        if num_pages <= room:
            return True
        heap = [
            (n.last_access_time, n.node_id, n)
            for n in self.iter_nodes()
            if id(n) not in protect and self._storage_evictable(n)
        ]
        heapq.heapify(heap)
        while room < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not self._storage_evictable(node):
                continue
            room += len(node.key) // self.page_size
            if node.value.size or node.host_pages is not None:
                self._delete_storage(node)
            else:
                parent = node.parent
                self._drop_subtree(node)
                if id(parent) not in protect and self._storage_evictable(parent):
                    heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        return room >= num_pages


def tree_state(tree: RadixCache) -> tuple:
    """Everything eviction decides: which nodes are left, where, and what each holds."""
    nodes = sorted(
        (
            n.node_id,
            n.parent.node_id,
            n.key.tolist(),
            n.value.tolist(),
            n.lock_ref,
            n.last_access_time,
            None if getattr(n, "host_pages", None) is None else n.host_pages.tolist(),
            getattr(n, "on_disk", False),
        )
        for n in tree.iter_nodes()
    )
    return nodes, tree.allocator.free_page_list(), tree.evictable_size(), tree.protected_size()


def tier_state(pool: KVPool) -> tuple:
    """:func:`tree_state` up to which device pages: pages freed behind a copy join the
    free list when the copy thread is done, so which pages are handed out next (not how
    many are free) is timing's."""
    tree, allocator = pool.hicache, pool.allocator
    nodes = sorted(
        (
            n.node_id,
            n.parent.node_id,
            n.key.tolist(),
            bool(n.value.size),
            n.lock_ref,
            n.last_access_time,
            None if n.host_pages is None else n.host_pages.tolist(),
            n.on_disk,
        )
        for n in tree.iter_nodes()
    )
    return nodes, allocator.num_free_pages, tree.host.free_list().tolist(), tree.evictable_size()


# -- the radix cache -------------------------------------------------------------------

RADIX_OPS = ["insert", "insert", "match", "lock", "unlock", "evict"]


@pytest.mark.parametrize("page_size", [1, 4])
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_radix_evicts_in_the_full_walk_order(page_size: int, data: st.DataObject) -> None:
    caches = [make_cache(page_size, num_pages=32) for _ in range(2)]
    caches[1].__class__ = FullWalkRadixCache
    held: list[list] = [[], []]  # per cache: the nodes locked, in the same order
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(RADIX_OPS), label="op")
        tokens = toks(
            page_size,
            data.draw(st.lists(st.integers(0, 3), max_size=6), label="pages"),
        )
        num_tokens = data.draw(st.integers(0, 12), label="num_tokens")
        results = []
        for cache, locks in zip(caches, held, strict=True):
            if op == "insert":
                slots = cache.allocator.alloc(len(tokens))
                if slots is None:
                    results.append(None)
                    continue
                prefix_len = cache.insert(tokens, slots)
                cache.allocator.free(slots[:prefix_len])
                results.append(prefix_len)
            elif op in ("match", "lock"):
                match = cache.match_prefix(tokens)
                if op == "lock":
                    cache.lock(match.last_node)
                    locks.append(match.last_node)
                results.append(match.last_node.node_id)
            elif op == "unlock" and locks:
                cache.unlock(locks.pop(num_tokens % len(locks)))
            elif op == "evict":
                results.append(cache.evict(num_tokens))
        assert results[:1] * len(results) == results
        assert tree_state(caches[0]) == tree_state(caches[1])
        assert_integrity(caches[0])
    for node in held[0]:
        caches[0].unlock(node)
    caches[0].evict(caches[0].evictable_size())
    assert_integrity(caches[0], idle=True)


# -- the hierarchy ---------------------------------------------------------------------

HI_OPS = ["request", "request", "hold", "release", "evict", "evict_host", "flush"]


def hi_tokens(data: st.DataObject) -> np.ndarray:
    pages = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4), label="pages")
    out = [np.arange(k * PAGE + 1, (k + 1) * PAGE + 1) for k in pages]
    return np.concatenate([*out, [100]]).astype(np.int64)


def hi_step(
    pool: KVPool, op: str, tokens: np.ndarray, num: int, held: list[tuple[str, np.ndarray]]
) -> object:
    """One operation on a pool (each pool of a pair gets the same); returns its outcome."""
    if op in ("request", "hold"):
        rid = f"r{pool.n}"
        pool.n += 1
        pool.open_request(rid)
        match = pool.match_prefix_tiers(rid, tokens[:-1])
        pool.settle_copies()
        slots = pool.alloc_extend([(rid, len(tokens) - match.prefix_len)])
        if slots is None:
            pool.release(rid, is_insert=False)
        elif op == "hold":
            held.append((rid, tokens))
        else:
            pool.release(rid, tokens)
        return match.prefix_len, slots is None
    if op == "release" and held:
        rid, tokens = held.pop(num % len(held))
        pool.release(rid, tokens)
        return rid
    if op == "evict":
        return pool.evict(num)
    if op == "evict_host":
        return pool.hicache.evict_host(num // PAGE)
    if op == "flush" and num % 4 == 0:
        return pool.flush_cache(device_only=num % 8 == 0)
    return None


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
@pytest.mark.parametrize("storage", [None, "file"])
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_hierarchy_evicts_in_the_full_walk_order(
    policy: str, storage: str | None, data: st.DataObject
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="evict-order-"))
    pools = [
        make_pool(
            tmp / str(i),
            num_pages=10,
            host_pages=5,
            policy=policy,
            storage=storage,
            storage_pages=6,
        )
        for i in range(2)
    ]
    pools[1].hicache.__class__ = FullWalkHiRadixCache
    held: list[list[tuple[str, np.ndarray]]] = [[], []]
    try:
        for pool in pools:
            pool.n = 0
        for _ in range(data.draw(st.integers(1, 30), label="steps")):
            op = data.draw(st.sampled_from(HI_OPS), label="op")
            tokens = hi_tokens(data)
            num = data.draw(st.integers(0, 24), label="num")
            results = [
                hi_step(pool, op, tokens, num, locks)
                for pool, locks in zip(pools, held, strict=True)
            ]
            for pool in pools:
                pool.settle_copies()
            assert results[0] == results[1]
            assert tier_state(pools[0]) == tier_state(pools[1])
            assert pools[0].hicache._storage_keys == pools[1].hicache._storage_keys
            pools[0].check_integrity()
        for rid, _ in held[0]:
            pools[0].release(rid, is_insert=False)
        pools[0].settle_copies()
        pools[0].check_integrity(idle=True)
    finally:
        for pool in pools:
            pool.close()
        shutil.rmtree(tmp, ignore_errors=True)


# -- eviction does not walk the tree ----------------------------------------------------


def forbid_walks(tree: RadixCache, monkeypatch: pytest.MonkeyPatch) -> None:
    def walk() -> None:
        raise AssertionError("eviction walked the tree")

    monkeypatch.setattr(tree, "iter_nodes", walk)
    monkeypatch.setattr(tree, "_checked_nodes", walk)


def grow(cache: RadixCache, num_leaves: int, page_size: int) -> None:
    """``num_leaves`` leaves under a shared first page: one split, then a leaf each."""
    for i in range(num_leaves):
        tokens = np.concatenate([np.zeros(page_size), np.full(page_size, i + 1)]).astype(np.int64)
        slots = cache.allocator.alloc(len(tokens))
        cache.allocator.free(slots[: cache.insert(tokens, slots)])


@pytest.mark.parametrize("num_leaves", [8, 200, 2000])
def test_radix_evict_pops_what_it_evicts_whatever_the_tree_size(
    num_leaves: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(1, num_pages=2 * num_leaves + 8)
    grow(cache, num_leaves, 1)
    assert_integrity(cache)
    heap = cache._free_leaves
    pops = []
    real_pop = heap.pop
    monkeypatch.setattr(type(heap), "pop", lambda self: pops.append(1) or real_pop())
    with monkeypatch.context() as patched:
        forbid_walks(cache, patched)
        assert cache.evict(3) == 3
    assert len(pops) == 3  # the three least recently used leaves, nothing else looked at
    assert_integrity(cache)


def test_hierarchy_evictions_do_not_walk_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="evict-walk-"))
    pool = make_pool(tmp, num_pages=12, host_pages=4, storage="file", storage_pages=6)
    try:
        for i in range(8):
            tokens = np.concatenate([np.arange(PAGE) + 10 * i + 1, [500]]).astype(np.int64)
            pool.open_request(f"r{i}")
            match = pool.match_prefix_tiers(f"r{i}", tokens[:-1])
            assert pool.alloc_extend([(f"r{i}", len(tokens) - match.prefix_len)]) is not None
            pool.release(f"r{i}", tokens)  # write_through: the host tier fills, then storage
        pool.settle_copies()
        with monkeypatch.context() as patched:
            forbid_walks(pool.hicache, patched)
            assert pool.evict(2 * PAGE) == 2 * PAGE
            assert pool.hicache.evict_host(2) == 2
        pool.settle_copies()
        pool.check_integrity()
        assert pool.hicache.storage_used_bytes()  # the host evictions demoted to storage
    finally:
        pool.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_check_finds_a_free_leaf_missing_from_the_heap() -> None:
    cache = make_cache(1, num_pages=16)
    grow(cache, 3, 1)
    cache._free_leaves._heap.clear()
    with pytest.raises(IntegrityError, match="not in its heap"):
        cache.check()
