"""A hypothesis state machine over the tiered radix tree (KVPool with the hierarchy).

Rules: start a request (match over all tiers, load, check the loaded KV value by
value, extend), finish it (insert) or abort it (free), match and leave while the
load may still be running, evict from the device and
from the host tier, retract running requests into the tree, expire the
"session" holding them all (the reclaim path: free without insert), under each
write policy, with and without a storage tier, while the copy thread really
runs the copies concurrently; and with storage faults (issue 26): page files
deleted, cut short, flipped, zeroed, swapped or linked behind memsvc's back,
and a disk that fills up (:class:`FullDiskStorage`). A damaged page is never
served: a request whose load fails finds a shorter match, or is told at its
``alloc_extend`` (``PrefixCutError``), and recomputes from the prefix it still
holds. After every step: the pool's integrity check
(pages in exactly one place per tier, bytes accounted); a matched prefix must
be a prefix of a sequence inserted before; a match's host / storage part is
loaded whole or not at all, never when under SGLang's load-back threshold, and
always when it is long enough and fits the free device pages (without faults);
at the end, the idle check.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memsvc.core import KVPool
from memsvc.core.errors import PrefixCutError
from memsvc.core.hicache import (
    LOAD_BACK_THRESHOLD,
    HiCacheConfig,
    HiRadixCache,
    page_hash_chain,
)
from memsvc.core.storage.file import SUFFIX
from tests.core.storage_faults import DAMAGE_KINDS, FullDiskStorage, damage_file
from tests.core.test_hicache import PAGE, kv_of, kv_shape, layout

pages_st = st.lists(st.integers(0, 2), min_size=1, max_size=4)


def tokens_of(pages: list[int], tail: int) -> np.ndarray:
    out = [np.arange(k * PAGE + 1, (k + 1) * PAGE + 1) for k in pages]
    return np.concatenate([*out, np.arange(tail) + 100]).astype(np.int64)


def cached_lens(tree: HiRadixCache, tokens: np.ndarray) -> tuple[int, int]:
    """(on the device, in any tier): the cached prefix of ``tokens``, read without
    touching the tree (no access stamps, no split)."""
    node, matched, device = tree.root, 0, 0
    while matched < len(tokens):
        rest = tokens[matched:]
        child = next(
            (c for c in node.children.values() if np.array_equal(c.key[:PAGE], rest[:PAGE])),
            None,
        )
        if child is None:
            break
        n = min(len(child.key), len(rest))
        common = int(np.argmin(np.append(child.key[:n] == rest[:n], False)))
        common -= common % PAGE
        if child.value.size and device == matched:
            device += common
        matched += common
        if common < len(child.key):
            break
        node = child
    return device, matched


class TieredTree(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: KVPool | None = None
        self.dir = tempfile.mkdtemp(prefix="hicache-model-")
        self.running: dict[str, np.ndarray] = {}  # rid -> tokens whose KV is written
        self.inserted: set[tuple[int, ...]] = set()  # page-aligned prefixes ever inserted
        self.whole: set[tuple[int, ...]] = set()  # ... the longest of each insert
        self.n = 0
        self.faulty = False  # a page damaged or a write failed: matches may come out shorter

    @initialize(
        policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
        storage=st.sampled_from([True, True, False]),
        host_pages=st.integers(1, 12),
    )
    def setup(self, policy: str, storage: bool, host_pages: int) -> None:
        lay = layout(10)
        self.pool = KVPool(
            lay,
            hicache=HiCacheConfig(
                size_bytes=host_pages * lay.bytes_per_page,
                write_policy=policy,
                storage_backend="file" if storage else None,
                storage_dir=self.dir,
                storage_size_bytes=12 * lay.bytes_per_page,
            ),
        )
        if storage:
            self.pool.hicache.storage = FullDiskStorage(self.pool.hicache.storage)

    def _remember(self, tokens: np.ndarray) -> None:
        aligned = len(tokens) - len(tokens) % PAGE
        for end in range(PAGE, aligned + 1, PAGE):
            self.inserted.add(tuple(tokens[:end].tolist()))
        if aligned:
            self.whole.add(tuple(tokens[:aligned].tolist()))

    @rule(pages=pages_st, tail=st.integers(1, 3), keep=st.booleans())
    def start(self, pages: list[int], tail: int, keep: bool) -> None:
        self._start(tokens_of(pages, tail), keep)

    @precondition(lambda self: self.whole)
    @rule(data=st.data(), keep=st.booleans(), evict=st.booleans(), squeeze=st.booleans())
    def start_again(self, data: st.DataObject, keep: bool, evict: bool, squeeze: bool) -> None:
        """A request over a sequence inserted before, maybe after evicting the device (so
        that long host / storage prefixes are hit), maybe while another request holds all
        free device pages but one (so that they may not fit)."""
        pool = self.pool
        prefix = data.draw(st.sampled_from(sorted(self.whole)))
        if evict:
            pool.evict(pool.evictable_size())
        squeeze = squeeze and pool.available_size() > PAGE
        if squeeze:
            pool.open_request("squeeze")
            assert pool.alloc_extend([("squeeze", pool.available_size() - PAGE)]) is not None
        self._start(np.array([*prefix, 100], dtype=np.int64), keep)
        if squeeze:
            pool.release("squeeze", is_insert=False)

    def _start(self, tokens: np.ndarray, keep: bool) -> None:
        pool = self.pool
        self.n += 1
        rid = f"r{self.n}"
        pool.open_request(rid)
        device_len, cached_len = cached_lens(pool.hicache, tokens[:-1])
        free_tokens = pool.available_size()
        match = pool.match_prefix_tiers(rid, tokens[:-1])
        assert match.prefix_len == match.device_tokens + match.host_tokens + match.storage_tokens
        if not self.faulty:  # else a load that failed before may have cut the match
            assert match.device_tokens == device_len
            tail_len, loaded = cached_len - device_len, match.host_tokens + match.storage_tokens
            assert loaded in (0, tail_len)  # all or nothing
            if tail_len < LOAD_BACK_THRESHOLD:
                assert loaded == 0
            elif tail_len <= free_tokens:
                assert loaded == tail_len
        if match.prefix_len:
            assert tuple(tokens[: match.prefix_len].tolist()) in self.inserted
        prefix_len = match.prefix_len
        try:
            slots = pool.alloc_extend([(rid, len(tokens) - prefix_len)])
        except PrefixCutError as exc:
            assert self.faulty, exc
            assert list(exc.cut) == [rid] and exc.cut[rid] < prefix_len
            prefix_len = exc.cut[rid]  # recompute from the good prefix
            slots = pool.alloc_extend([(rid, len(tokens) - prefix_len)])
        got = pool.buffers.read_slots(pool.slots(rid, 0, prefix_len))
        np.testing.assert_array_equal(got, kv_of(tokens[:prefix_len], 0, kv_shape(pool)))
        if slots is None:
            pool.release(rid, is_insert=False)
            return
        pool.buffers.write_slots(slots, kv_of(tokens, prefix_len, kv_shape(pool)))
        if keep:
            self.running[rid] = tokens
        else:
            pool.release(rid, tokens)
            self._remember(tokens)

    @rule(pages=pages_st)
    def abandon_match(self, pages: list[int]) -> None:
        """Match (a load may start), then leave before any alloc_extend waited for it."""
        self.n += 1
        rid = f"r{self.n}"
        tokens = tokens_of(pages, 1)
        self.pool.open_request(rid)
        self.pool.match_prefix_tiers(rid, tokens[:-1])
        self.pool.release(rid, is_insert=False)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data: st.DataObject, insert: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        tokens = self.running.pop(rid)
        if insert:
            self.pool.release(rid, tokens)
            self._remember(tokens)
        else:
            self.pool.release(rid, is_insert=False)

    @rule(num_tokens=st.integers(0, 40))
    def evict_device(self, num_tokens: int) -> None:
        self.pool.evict(num_tokens)

    @rule(num_pages=st.integers(0, 10))
    def evict_host(self, num_pages: int) -> None:
        self.pool.hicache.evict_host(num_pages)

    @precondition(lambda self: len(self.running) >= 2)
    @rule()
    def retract_into_tree(self) -> None:
        pool = self.pool
        rids = sorted(self.running)
        rows = [pool.request(r).row for r in rids]
        to_tree = {pool.request(r).row: self.running[r] for r in rids}
        result = pool.retract(rows, offload=False, retract_decode_steps=2, to_tree=to_tree)
        assert result.retracted and result.to_tree == result.retracted
        for rid in result.retracted:
            self._remember(self.running.pop(rid))

    @precondition(lambda self: self.running)
    @rule()
    def expire_session(self) -> None:
        for rid in list(self.running):
            self.pool.release(rid, is_insert=False)  # what reclaiming a session does
        self.running.clear()

    @rule()
    def settle(self) -> None:
        self.pool.settle_copies()

    def _loadable(self) -> list[tuple[int, ...]]:
        """Sequences inserted before that are long enough to be loaded back."""
        return sorted(p for p in self.whole if len(p) >= LOAD_BACK_THRESHOLD)

    @precondition(lambda self: self._loadable() and self.pool.hicache.storage is not None)
    @rule(data=st.data(), kind=st.sampled_from(DAMAGE_KINDS), keep=st.booleans())
    def damage_and_reload(self, data: st.DataObject, kind: str, keep: bool) -> None:
        """A page of a sequence inserted before changes behind memsvc's back once the
        unlocked KV went down to storage; then a request over that sequence."""
        pool = self.pool
        prefix = data.draw(st.sampled_from(self._loadable()))
        pool.evict(pool.evictable_size())
        pool.hicache.evict_host(pool.hicache.host.num_pages)
        pool.settle_copies()
        directory = pool.hicache.storage.directory
        names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))
        keys = page_hash_chain("", np.array(prefix, dtype=np.int64), PAGE)
        ours = [k + SUFFIX for k in keys if k + SUFFIX in names]
        if ours:
            name, other = data.draw(st.sampled_from(ours)), data.draw(st.sampled_from(names))
            offset = data.draw(st.integers(0, 1 << 12))
            path = os.path.join(directory, name)
            damage_file(path, kind, os.path.join(directory, other), offset)
            self.faulty = True
        self._start(np.array([*prefix, 100], dtype=np.int64), keep)

    @precondition(lambda self: self.pool is not None and self.pool.hicache.storage is not None)
    @rule(full=st.booleans())
    def disk_full(self, full: bool) -> None:
        """Every storage write fails (ENOSPC) from now on, or works again."""
        self.pool.hicache.storage.full = full
        self.faulty |= full

    @invariant()
    def integrity(self) -> None:
        if self.pool is not None:
            self.pool.check_integrity()
            # Scribble on free pages (no copy touches them): a load that did not
            # copy, or copied too late, then shows as wrong KV.
            free = np.array(self.pool.allocator.free_page_list(), dtype=np.int64)
            self.pool.buffers.kv[free] = -1

    def teardown(self) -> None:
        try:
            if self.pool is not None:
                for rid in list(self.running):
                    self.pool.release(rid, is_insert=False)
                self.pool.settle_copies()
                if self.faulty:  # a page deleted behind its back is missing until read
                    self.pool.flush_cache()
                self.pool.check_integrity(idle=True)
        finally:
            if self.pool is not None:
                self.pool.close()
            shutil.rmtree(self.dir, ignore_errors=True)


TieredTree.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, derandomize=True
)
test_tiered_tree = TieredTree.TestCase
