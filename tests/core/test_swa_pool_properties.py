"""Property test of the hybrid (sliding-window) pool: the two-pool allocator, the windows
and the SWA radix cache, under random sequences of operations, integrity after every step.

Each position's full KV and SWA KV are written as values derived from the token prefix
up to it (different for the two pools), so a page shared, evicted or tombstoned wrongly
shows up as a wrong value. The worker's view is checked after every step: for each open
request, every position a query still to run may read (from ``start - W + 1`` on, for
the ``start`` of its two latest allocations: under the overlap schedule the one before
the latest may still be running; before any, its matched prefix's tail) maps to a live
SWA page holding that position's value. A decode slot reserved ahead may be handed back
unwritten (a publish of one token fewer): the step re-taking it must leave the one
before covered too.
"""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from memsvc.core import KVPool, PoolLayout

F, S = "full_attention", "sliding_attention"
BASE_PROMPTS = [list(range(1, 40)), list(range(1, 20)) + list(range(60, 80)), [5] * 30]


def prefix_value(tokens: list[int], pos: int, salt: int) -> float:
    data = np.asarray([salt, *tokens[: pos + 1]], dtype=np.int64).tobytes()
    return float(zlib.crc32(data) % 65521)


def hybrid_pool(
    page_size: int, window: int, swa_pages: int, radix: bool, layer_types=(S, F, S)
) -> KVPool:
    layout = PoolLayout(
        num_layers=3,
        layer_types=layer_types,
        sliding_window=window,
        swa_num_pages=swa_pages,
        num_kv_heads=1,
        head_dim=2,
        page_size=page_size,
        num_pages=192 // page_size,
        max_running_requests=6,
        max_context_len=128,
        dtype="float32",
    )
    return KVPool(layout, disable_radix_cache=not radix, host_store_bytes=1 << 20)


class SWAPoolMachine(RuleBasedStateMachine):
    open_rids = Bundle("open_rids")

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 12),
        swa_tokens=st.sampled_from([24, 48, 96]),
        radix=st.booleans(),
        pure_swa=st.booleans(),  # every layer windowed: the full pool has no bytes
    )
    def setup(
        self, page_size: int, window: int, swa_tokens: int, radix: bool, pure_swa: bool
    ) -> None:
        layer_types = (S, S, S) if pure_swa else (S, F, S)
        self.pool = hybrid_pool(page_size, window, swa_tokens // page_size, radix, layer_types)
        self.window = window
        self.seqs: dict[str, list[int]] = {}
        self.starts: dict[str, list[int]] = {}  # rid -> its allocations' starts, in order
        self.reserved: set[str] = set()  # rids whose last allocation was one decode step
        self.tried: set[str] = set()  # reserved rids an allocation since did not fit
        self.counter = 0

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        try:
            for rid in self.pool.open_rids():
                self.pool.release(rid, is_insert=False)
            self.pool.check_integrity(idle=True)
            self.pool.evict(self.pool.capacity)
            assert self.pool.full_available_size() == self.pool.capacity
            assert self.pool.swa_available_size() == self.pool.swa_capacity
            assert not self.pool.buffers.full_to_swa_page.any()
        finally:
            self.pool.close()

    # -- KV as the worker writes and reads it --------------------------------------

    def write_kv(self, rid: str, start: int, slots: np.ndarray) -> None:
        pool, seq, ps = self.pool, self.seqs[rid], self.pool.page_size
        for i, slot in enumerate(slots.tolist()):
            pos = start + i
            pool.buffers.kv[slot // ps, :, :, slot % ps] = prefix_value(seq, pos, 0)
            swa_page = int(pool.buffers.full_to_swa_page[slot // ps])
            assert swa_page, "a freshly allocated position has no SWA page"
            pool.buffers.swa_kv[swa_page, :, :, slot % ps] = prefix_value(seq, pos, 1)

    def expect_kv(self, rid: str) -> None:
        pool, ps = self.pool, self.pool.page_size
        req = pool.request(rid)
        slots = pool.slots(rid)
        seq = self.seqs[rid]
        if pool.layout.num_full_layers:
            full = pool.buffers.kv[slots // ps, 0, 0, slots % ps, 0, 0]
            assert full.tolist() == [prefix_value(seq, p, 0) for p in range(req.kv_len)]
        # the worker's reads: queries of the two latest allocations (or the first extend)
        starts = self.starts[rid][-2:] or [req.protected_len]
        first = max(0, min(starts) - self.window + 1)
        for pos in range(first, req.kv_len):
            swa_page = int(pool.buffers.full_to_swa_page[slots[pos] // ps])
            assert swa_page, f"{rid}: position {pos} in the window has no SWA page"
            got = pool.buffers.swa_kv[swa_page, 0, 0, slots[pos] % ps, 0, 0]
            assert got == prefix_value(seq, pos, 1), f"{rid}: SWA KV of {pos} is wrong"

    def budgets(self) -> tuple[int, int]:
        pool = self.pool
        return (
            pool.full_available_size() + pool.evictable_size(),
            pool.swa_available_size() + pool.swa_evictable_size(),
        )

    # -- rules ------------------------------------------------------------------------

    @precondition(lambda self: self.pool.table.available_size() > 0)
    @rule(
        target=open_rids,
        base=st.sampled_from(range(len(BASE_PROMPTS))),
        suffix=st.lists(st.integers(1, 9), max_size=12),
        cut=st.integers(5, 39),
    )
    def open_and_match(self, base: int, suffix: list[int], cut: int):
        self.counter += 1
        rid = f"r{self.counter}"
        self.seqs[rid] = BASE_PROMPTS[base][:cut] + suffix + list(range(200, 260))
        self.pool.open_request(rid)
        self.starts[rid] = []
        prompt_len = cut + len(suffix)
        hit = self.pool.match_prefix(rid, self.seqs[rid][: prompt_len - 1])
        assert hit % self.pool.page_size == 0 and hit <= prompt_len - 1
        self.expect_kv(rid)
        return rid

    @rule(rid=open_rids, num_tokens=st.integers(1, 24))
    def extend(self, rid: str, num_tokens: int) -> None:
        req = self.pool.request(rid)
        num_tokens = min(num_tokens, len(self.seqs[rid]) - req.kv_len)
        start = req.kv_len
        needed = self.pool.extend_tokens_required([(rid, num_tokens)])
        if num_tokens:
            # an allocation frees what left the latest allocation's window first (the one
            # before it has run by then), and may use it, whether it then fits or not
            self.pool.swa.release(np.array([req.row]))
            self.starts[rid] = self.starts[rid][-1:]
            self.expect_kv(rid)
        full_budget, swa_budget = self.budgets()
        slots = self.pool.alloc_extend([(rid, num_tokens)])
        assert (slots is not None) == (needed <= min(full_budget, swa_budget))
        if slots is None and num_tokens and rid in self.reserved:
            self.tried.add(rid)
        if slots is not None and num_tokens:
            self.starts[rid].append(start)
            self.reserved.discard(rid)
            self.tried.discard(rid)
            self.write_kv(rid, start, slots)

    @rule(data=st.data())
    def decode(self, data) -> None:
        rids = [
            r for r in self.pool.open_rids() if 0 < self.pool.request(r).kv_len < len(self.seqs[r])
        ]
        if not rids:
            return
        batch = data.draw(st.lists(st.sampled_from(rids), min_size=1, unique=True))
        starts = [self.pool.request(r).kv_len for r in batch]
        fits = self.pool.check_decode_mem(batch)  # frees what left the latest windows first
        for rid in batch:
            self.starts[rid] = self.starts[rid][-1:]
            self.expect_kv(rid)
        slots = self.pool.alloc_decode(batch)
        assert (slots is not None) == fits
        if slots is None:
            self.tried.update(self.reserved.intersection(batch))
        else:
            self.tried.difference_update(batch)
        if slots is not None:
            for rid, start, slot in zip(batch, starts, slots, strict=True):
                self.starts[rid].append(start)
                self.reserved.add(rid)
                self.write_kv(rid, start, np.array([slot]))

    @rule(rid=open_rids)
    def cache_unfinished(self, rid: str) -> None:
        kv_len = self.pool.request(rid).kv_len
        self.pool.cache_unfinished(rid, self.seqs[rid][:kv_len])

    @rule(rid=open_rids)
    def publish_handing_back_a_reserved_slot(self, rid: str) -> None:
        """The overlap schedule reserved the next decode slot; the publish hands it back."""
        req = self.pool.request(rid)
        if rid not in self.reserved or req.kv_len - 1 < req.protected_len:
            return  # the last allocation was not one decode step (reserved ahead)
        self.pool.cache_unfinished(rid, self.seqs[rid][: req.kv_len - 1])
        self.reserved.discard(rid)
        # it never ran; the step before it may still be running, the ones before that not;
        # unless an allocation since (that did not fit) found that one had run
        if rid not in self.tried:
            self.starts[rid] = self.starts[rid][-2:-1]
        self.tried.discard(rid)

    @rule(rid=consumes(open_rids), is_insert=st.booleans())
    def release(self, rid: str, is_insert: bool) -> None:
        kv_len = self.pool.request(rid).kv_len
        self.pool.release(rid, self.seqs[rid][:kv_len], is_insert=is_insert)

    @rule(rid=open_rids)
    def offload_and_load(self, rid: str) -> None:
        """A retract by offload and its resume: every position's full KV and the window's
        SWA KV come back into fresh pages (the host store keeps the SWA tail alone)."""
        pool = self.pool
        kv_len = pool.request(rid).kv_len
        if not kv_len:
            return
        pool.offload(rid)
        ps = pool.page_size
        tail = max(0, kv_len - self.window) // ps * ps  # SGLang's SWA tail start
        frontier = max(0, kv_len + 1 - self.window) // ps * ps  # the next query's window
        assert tail <= pool.host_store.swa_from(rid) <= frontier
        pool.release(rid, is_insert=False)
        pool.open_request(rid)
        slots = pool.load(rid)
        if slots is None:  # no room even after evicting: it stays out, as a retracted request
            pool.host_discard(rid)
            self.starts[rid] = []
        else:  # nothing has run on the loaded row: the next query reads from kv_len - W + 1
            assert slots.size == kv_len
            self.starts[rid] = [kv_len]
        self.reserved.discard(rid)
        self.tried.discard(rid)

    @rule(num_tokens=st.integers(0, 48))
    def evict(self, num_tokens: int) -> None:
        before = self.pool.evictable_size()
        evicted = self.pool.evict(num_tokens)
        assert evicted >= min(num_tokens, before)
        assert self.pool.evictable_size() == before - evicted

    @rule(num_tokens=st.integers(0, 48))
    def evict_swa(self, num_tokens: int) -> None:
        before, full_before = self.pool.swa_evictable_size(), self.pool.evictable_size()
        available = self.pool.swa_available_size()
        evicted = self.pool.evict_swa(num_tokens)
        assert evicted >= min(num_tokens, before)
        assert self.pool.swa_evictable_size() == before - evicted
        assert self.pool.swa_available_size() == available + evicted
        assert self.pool.evictable_size() == full_before  # tombstones keep the full KV

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "pool"):
            self.pool.check_integrity()
            for rid in self.pool.open_rids():
                self.expect_kv(rid)


SWAPoolMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSWAPoolProperties = SWAPoolMachine.TestCase
