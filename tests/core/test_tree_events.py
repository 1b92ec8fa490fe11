"""KV events from the tree (issue 31, part 4): a router rebuilding a node's cached blocks
from SGLang's events (stored minus removed, per medium; cleared) must see exactly what
memsvc's tree holds in each tier, after inserts, splits, evictions, retracts, loads,
demotions to storage and flushes. Block hashes are checked against SGLang's hashing,
written independently in tests/kv_events_subscriber.py.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from memsvc.core import KVPool
from memsvc.core.tree_events import TreeEventRecorder, page_digests
from memsvc.kv_events import encode_batch
from memsvc.namespace import namespace_of
from tests.core.test_hicache import PAGE, finish, layout, make_pool, run_request, seq
from tests.kv_events_subscriber import CPU, GPU, BlockIndex, expected_blocks, sglang_page_hashes


class Watcher:
    """A recorder on ``pool``'s tree and the router view its events build."""

    def __init__(self, pool: KVPool, storage_medium: str = "DISK") -> None:
        self.pool = pool
        self.medium = storage_medium
        self.recorder = TreeEventRecorder(
            pool.tree.root, pool.tree.page_size, storage_medium=storage_medium
        )
        pool.tree.events = self.recorder
        self.index = BlockIndex()

    def sync(self) -> dict[str, dict[int, list[int]]]:
        """Apply what was recorded as one batch; the view must be the tree's."""
        events = self.recorder.take()
        if events:
            self.index.apply_payload(encode_batch(time.time(), events))
        view = self.index.view()
        assert view == expected_blocks(self.pool.tree, self.medium)
        return view


def test_page_hash_is_sglangs():
    """SHA-256 chained over the previous digest and the page as little-endian uint32;
    the event carries the first 8 bytes big-endian, signed."""
    key = np.array([1, 2, 3, 4, 70000, 6, 7, 8])
    first = hashlib.sha256(np.array([1, 2, 3, 4], "<u4").tobytes()).digest()
    second = hashlib.sha256(first + np.array([70000, 6, 7, 8], "<u4").tobytes()).digest()
    assert page_digests(None, key, 4) == [first, second]
    assert sglang_page_hashes(key.tolist(), 4) == [
        int.from_bytes(d[:8], "big", signed=True) for d in (first, second)
    ]
    # a token past uint32 switches the page to SGLang's wide form
    wide = np.array([2**33, 1])
    assert page_digests(None, wide, 2) == [
        hashlib.sha256(b"\xff" + wide.astype("<u8").tobytes()).digest()
    ]


def test_device_tree_inserts_splits_evictions_retracts_flush():
    pool = KVPool(layout(num_pages=12))
    watch = Watcher(pool)
    a = seq(1, 4)
    run_request(pool, "a", a)
    view = watch.sync()
    assert set(view) == {GPU} and len(view[GPU]) == 4
    # a shared prefix splits a's node: no event, the blocks are the same
    b = np.concatenate([a[: 2 * PAGE], seq(2, 2)])
    run_request(pool, "b", b)
    assert len(watch.sync()[GPU]) == 6
    # a salted request: its own namespace, its own blocks for the same tokens
    pool.open_request("s", namespace_of("tenant", None))
    pool.alloc_extend([("s", len(a))])
    pool.release("s", a)
    assert len(watch.sync()[GPU]) == 10
    # retract: a running request's KV is freed without an insert (no event)
    pool.open_request("r")
    pool.match_prefix("r", a[:-1])
    pool.alloc_extend([("r", 2 * PAGE)])
    pool.release("r", is_insert=False)
    assert len(watch.sync()[GPU]) == 10
    # eviction under pressure: a new prompt that needs pages
    pool.evict(2 * PAGE)
    after = watch.sync()
    assert len(after[GPU]) == 8
    run_request(pool, "c", seq(3, 2))
    watch.sync()
    pool.evict(pool.evictable_size())  # node by node: split halves name their own blocks
    assert watch.sync() == {}
    run_request(pool, "d", a)
    pool.flush_cache()
    assert watch.sync() == {}
    assert watch.index.num_cleared == 1
    finish(pool)


def test_flush_with_a_locked_request_removes_the_rest_only():
    pool = KVPool(layout(num_pages=12))
    watch = Watcher(pool)
    run_request(pool, "a", seq(4, 2))
    held = seq(5, 2)
    run_request(pool, "held", held, release=False)
    pool.cache_unfinished("held", held)
    watch.sync()
    pool.flush_cache()
    view = watch.sync()
    assert len(view[GPU]) == 2 and watch.index.num_cleared == 0
    pool.release("held", held)
    pool.flush_cache()
    assert watch.sync() == {}
    finish(pool)


def test_hicache_host_and_storage_tiers_carry_their_medium(tmp_path):
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", storage_pages=16)
    watch = Watcher(pool)
    a, b = seq(10, 3), seq(11, 3)
    run_request(pool, "a", a)  # write_through: on the device and the host at once
    view = watch.sync()
    assert len(view[GPU]) == 3 and len(view[CPU]) == 3
    pool.evict(pool.evictable_size())  # a leaves the device, keeps its host copy
    view = watch.sync()
    assert GPU not in view and len(view[CPU]) == 3
    run_request(pool, "b", b)  # the host tier is full: a is demoted to storage
    pool.settle_copies()
    view = watch.sync()
    assert len(view["DISK"]) == 3 and len(view[GPU]) == 3
    match = run_request(pool, "a2", a)  # a comes back from storage
    assert match.storage_tokens == 3 * PAGE
    pool.settle_copies()
    view = watch.sync()
    assert {GPU, CPU, "DISK"} <= set(view)
    # a retract into the tree (normal-mode victim backed up to host)
    pool.open_request("v")
    c = seq(12, 1)
    pool.alloc_extend([("v", len(c))])
    pool.release_to_tree("v", c)
    pool.settle_copies()
    watch.sync()
    # a salted prompt pushed down to storage, then its namespace flushed: every tier's
    # removals, no AllBlocksCleared (the rest stays)
    salt = namespace_of("tenant", None)
    pool.open_request("s", salt)
    pool.alloc_extend([("s", len(b))])
    pool.release("s", b)
    pool.evict(pool.evictable_size())
    pool.tree.evict_host(pool.tree.host.num_pages)
    pool.settle_copies()
    before = watch.sync()
    pool.flush_cache(namespace=salt)
    pool.settle_copies()
    after = watch.sync()
    assert len(after["DISK"]) < len(before["DISK"]) and watch.index.num_cleared == 0
    pool.flush_cache()
    pool.settle_copies()
    assert watch.sync() == {}
    assert watch.index.num_cleared == 1
    finish(pool)


def test_write_back_backs_up_on_eviction_and_drops_host_copies(tmp_path):
    pool = make_pool(num_pages=8, host_pages=4, policy="write_back")
    watch = Watcher(pool)
    for i in range(4):
        run_request(pool, f"r{i}", seq(20 + i, 2))
        pool.settle_copies()
        watch.sync()
    assert watch.sync()[CPU]  # evictions under pressure backed pages up
    pool.tree.evict_host(pool.tree.host.num_pages)
    watch.sync()
    pool.flush_cache(device_only=True)
    watch.sync()
    pool.flush_cache()
    assert watch.sync() == {}
    finish(pool)


def test_events_merge_as_sglangs():
    """One store event per chain (a store continuing the previous one's last block
    joins it), one removal per medium run."""
    pool = KVPool(layout(num_pages=12))
    watch = Watcher(pool)
    run_request(pool, "a", seq(30, 3))
    events = watch.recorder.take()
    assert [e["type"] for e in events] == ["BlockStored"]
    assert events[0]["parent_block_hash"] is None and events[0]["block_size"] == PAGE
    watch.index.apply_payload(encode_batch(0.0, events))
    pool.flush_cache()
    events = watch.recorder.take()
    assert [e["type"] for e in events] == ["AllBlocksCleared"]
    finish(pool)


def test_sliding_window_pools_report_the_full_pool_tiers(tmp_path):
    """A hybrid model's tree (full + SWA pools, hierarchical): the events follow each
    node's full-pool KV in each tier; a window's SWA pages dropped (a tombstone) leave
    the node's blocks on the device."""
    from tests.core.test_swa_hicache import pool_of

    pool = pool_of(storage_dir=tmp_path / "store")
    watch = Watcher(pool)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, size=n).tolist() for n in (13, 21, 17, 9)]
    for i, tokens in enumerate(prompts):
        rid = f"r{i}"
        pool.open_request(rid)
        pool.match_prefix(rid, tokens[:-1])
        assert pool.alloc_extend([(rid, len(tokens) - pool.request(rid).kv_len)]) is not None
        pool.release(rid, tokens)
        pool.settle_copies()
        watch.sync()
    pool.evict_swa(8)
    watch.sync()
    pool.evict(pool.evictable_size())
    pool.settle_copies()
    assert GPU not in watch.sync()
    pool.open_request("back")
    assert pool.match_prefix("back", prompts[1][:-1]) > 0  # loaded back from the host
    pool.settle_copies()
    pool.release("back", is_insert=False)
    assert GPU in watch.sync()
    pool.flush_cache()
    pool.settle_copies()
    assert watch.sync() == {}
    finish(pool)
