"""Property test: random sequences of pool operations keep every invariant.

Each token position's KV is written as a value derived from the whole token
prefix up to it, so a page that is shared, evicted, offloaded or loaded
wrongly shows up as a wrong value, not only as wrong accounting.
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
    multiple,
    precondition,
    rule,
)

from memsvc.core import KVPool
from memsvc.core.errors import HostStoreFullError
from tests.helpers import small_layout

BASE_PROMPTS = [list(range(1, 40)), list(range(1, 20)) + list(range(60, 80)), [5] * 30]


def prefix_value(tokens: list[int], pos: int) -> float:
    """The KV value of position ``pos``: a function of ``tokens[: pos + 1]``."""
    return float(zlib.crc32(np.asarray(tokens[: pos + 1], dtype=np.int64).tobytes()) % 65521)


class PoolMachine(RuleBasedStateMachine):
    open_rids = Bundle("open_rids")
    parked_rids = Bundle("parked_rids")

    @initialize(page_size=st.sampled_from([1, 4, 16]), radix=st.booleans())
    def setup(self, page_size: int, radix: bool) -> None:
        layout = small_layout(
            page_size=page_size,
            num_pages=256 // page_size,
            dtype="float32",
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
            max_running_requests=6,
            max_context_len=128,
        )
        self.pool = KVPool(
            layout, host_store_bytes=96 * layout.bytes_per_token, disable_radix_cache=not radix
        )
        self.seqs: dict[str, list[int]] = {}  # rid -> its full token sequence
        self.parked: dict[str, int] = {}  # offloaded rid -> tokens offloaded
        self.counter = 0

    def teardown(self) -> None:
        """Finish everything: the pool must be back to idle, with nothing leaked."""
        if not hasattr(self, "pool"):
            return
        try:
            for rid in self.pool.open_rids():
                self.pool.release(rid, is_insert=False)
            for rid in self.parked:
                self.pool.host_discard(rid)
            self.pool.check_integrity(idle=True)
            self.pool.evict(self.pool.capacity)
            assert self.pool.available_size() == self.pool.capacity
        finally:
            self.pool.close()

    # -- helpers ---------------------------------------------------------------

    def write_kv(self, rid: str, start: int, slots: np.ndarray) -> None:
        seq = self.seqs[rid]
        values = np.array([prefix_value(seq, p) for p in range(start, start + slots.size)])
        data = np.broadcast_to(
            values[:, None, None, None, None], (slots.size, *self.pool.layout.kv_shape[1:3], 1, 2)
        )
        self.pool.buffers.write_slots(slots, np.ascontiguousarray(data, dtype=np.float32))

    def expect_kv(self, rid: str) -> None:
        req = self.pool.request(rid)
        got = self.pool.buffers.read_slots(self.pool.slots(rid))[:, 0, 0, 0, 0]
        want = [prefix_value(self.seqs[rid], p) for p in range(req.kv_len)]
        assert got.tolist() == want, f"KV of {rid} is wrong"

    # -- rules -----------------------------------------------------------------

    @precondition(lambda self: self.pool.table.available_size() > 0)
    @rule(
        target=open_rids,
        base=st.sampled_from(range(len(BASE_PROMPTS))),
        suffix=st.lists(st.integers(1, 9), max_size=20),
        cut=st.integers(5, 39),
    )
    def open_and_match(self, base: int, suffix: list[int], cut: int):
        self.counter += 1
        rid = f"r{self.counter}"
        self.seqs[rid] = BASE_PROMPTS[base][:cut] + suffix + [int(t) for t in range(200, 260)]
        self.pool.open_request(rid)
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
        slots = self.pool.alloc_extend([(rid, num_tokens)])
        if slots is None:
            assert self.pool.extend_tokens_required([(rid, num_tokens)]) > (
                self.pool.available_size() + self.pool.evictable_size()
            )
            return
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
        fits = self.pool.check_decode_mem(batch)
        slots = self.pool.alloc_decode(batch)
        assert (slots is not None) == fits
        if slots is not None:
            for rid, start, slot in zip(batch, starts, slots, strict=True):
                self.write_kv(rid, start, np.array([slot]))

    @rule(rid=open_rids)
    def cache_unfinished(self, rid: str) -> None:
        kv_len = self.pool.request(rid).kv_len
        self.pool.cache_unfinished(rid, self.seqs[rid][:kv_len])
        self.expect_kv(rid)

    @rule(rid=consumes(open_rids), is_insert=st.booleans())
    def release(self, rid: str, is_insert: bool) -> None:
        kv_len = self.pool.request(rid).kv_len
        self.pool.release(rid, self.seqs[rid][:kv_len], is_insert=is_insert)

    @rule(target=parked_rids, rid=consumes(open_rids))
    def offload_and_release(self, rid: str):
        kv_len = self.pool.request(rid).kv_len
        try:
            self.pool.offload(rid)
        except HostStoreFullError:
            self.pool.release(rid, is_insert=False)
            return multiple()
        self.pool.release(rid, is_insert=False)
        self.parked[rid] = kv_len
        return rid

    @precondition(lambda self: self.pool.table.available_size() > 0)
    @rule(target=open_rids, rid=consumes(parked_rids))
    def load(self, rid: str):
        self.pool.open_request(rid)
        slots = self.pool.load(rid)
        if slots is None:
            self.pool.host_discard(rid)
            self.pool.release(rid, is_insert=False)
            del self.parked[rid]
            return multiple()
        assert slots.size == self.parked.pop(rid)
        self.expect_kv(rid)
        return rid

    @rule(num_tokens=st.integers(0, 64))
    def evict(self, num_tokens: int) -> None:
        before = self.pool.evictable_size()
        evicted = self.pool.evict(num_tokens)
        assert evicted >= min(num_tokens, before) or self.pool.evictable_size() == 0
        assert self.pool.evictable_size() == before - evicted

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "pool"):
            self.pool.check_integrity()
            for rid in self.pool.open_rids():
                self.expect_kv(rid)


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolProperties = PoolMachine.TestCase
