"""The hierarchical cache over a hybrid (sliding-window) pool: a host copy keeps a node's
SWA KV with its full KV; a host hit loads both back (SWA for the pages that had it), and
a host node whose SWA tail is not stored is not a hit (the match stops where the tail
exists). Integrity (both pools, both host arenas) after every step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import consumes, initialize, precondition, rule

from memsvc.core import KVPool, PoolLayout
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.hicache import HiCacheConfig
from memsvc.core.swa_hicache import SWAHiRadixCache
from memsvc.core.swa_host_store import swa_pool_layout
from tests.core.test_swa_pool_properties import BASE_PROMPTS, SWAPoolMachine

F, S = "full_attention", "sliding_attention"
PS, W = 4, 10


def pool_of(policy: str = "write_through", layer_types=(S, F, S), storage_dir=None) -> KVPool:
    layout = PoolLayout(
        num_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=W,
        swa_num_pages=24,
        num_kv_heads=1,
        head_dim=2,
        page_size=PS,
        num_pages=24,
        max_running_requests=4,
        max_context_len=128,
        dtype="float32",
    )
    page_bytes = host_page_bytes(layout)
    config = HiCacheConfig(
        size_bytes=32 * page_bytes,
        write_policy=policy,
        disable_load_cost_model=True,
        storage_backend="file" if storage_dir else None,
        storage_dir=str(storage_dir) if storage_dir else "/nonexistent",
        storage_size_bytes=64 * page_bytes,
    )
    return KVPool(layout, hicache=config)


def host_page_bytes(layout: PoolLayout) -> int:
    """The bytes the host tier's size counts per page: the full pool's, or (a pure
    sliding-window layout, whose full pages hold nothing) the SWA pool's."""
    return layout.bytes_per_page or swa_pool_layout(layout).bytes_per_page


def value(pos: int, swa: bool) -> float:
    return -(pos + 1.0) if swa else pos + 1.0


def run(pool: KVPool, rid: str, tokens: list[int]) -> None:
    """Open ``rid``, compute ``tokens`` (one extend), write their KV, publish it all."""
    pool.open_request(rid)
    slots = pool.alloc_extend([(rid, len(tokens))])
    f2s = pool.buffers.full_to_swa_page
    for pos, slot in enumerate(slots.tolist()):
        pool.buffers.kv[slot // PS, :, :, slot % PS] = value(pos, False)
        pool.buffers.swa_kv[f2s[slot // PS], :, :, slot % PS] = value(pos, True)
    pool.release(rid, tokens)
    pool.check_integrity()


def poison(pool: KVPool) -> None:
    """Nothing on the device any more: every freed page's KV becomes NaN (so a load that
    does not copy shows)."""
    pool.settle_copies()
    assert pool.full_available_size() == pool.capacity
    pool.buffers.kv[:] = np.nan
    pool.buffers.swa_kv[:] = np.nan


def read_hit(pool: KVPool, rid: str, hit: int) -> tuple[list[float], list[float]]:
    slots = pool.slots(rid, 0, hit)
    f2s = pool.buffers.full_to_swa_page
    if pool.buffers.kv.shape[1]:
        full = pool.buffers.kv[slots // PS, 0, 0, slots % PS, 0, 0].tolist()
    else:  # a pure sliding-window pool: full pages hold nothing, as written
        full = [value(p, False) for p in range(hit)]
    tail = slots[max(0, hit - W) // PS * PS :]
    assert f2s[tail // PS].all(), "the hit's SWA tail has no SWA pages"
    swa = pool.buffers.swa_kv[f2s[tail // PS], 0, 0, tail % PS, 0, 0].tolist()
    return full, swa


TOKENS = list(range(100, 140))  # 40 tokens, 10 pages


PURE = (S, S)  # every layer windowed (Mistral): the full pool holds no bytes


@pytest.mark.parametrize("layer_types", [(S, F, S), PURE], ids=["hybrid", "pure"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_host_hit_reloads_the_swa_tail(policy: str, layer_types) -> None:
    with pool_of(policy, layer_types=layer_types) as pool:
        assert isinstance(pool.tree, SWAHiRadixCache)
        run(pool, "a", TOKENS)
        pool.evict(pool.capacity)  # every node off the device, its host copy kept
        assert pool.tree.tier_tokens()["host_only"] == 40
        poison(pool)
        pool.check_integrity()
        pool.open_request("b")
        match = pool.match_prefix_tiers("b", TOKENS[:39])
        assert match.prefix_len == 36 and match.host_tokens == 36
        pool.wait_loaded("b")
        full, swa = read_hit(pool, "b", 36)
        assert full == [value(p, False) for p in range(36)]
        assert swa == [value(p, True) for p in range(24, 36)]
        pool.check_integrity()
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_host_node_without_its_swa_tail_is_not_a_hit() -> None:
    with pool_of("write_back") as pool:
        run(pool, "a", TOKENS)
        pool.evict_swa(pool.swa_capacity)  # tombstones: the tree keeps full KV alone
        pool.evict(pool.capacity)  # write-back: host copies of the full KV, no SWA KV
        pool.check_integrity()
        pool.open_request("b")
        match = pool.match_prefix_tiers("b", TOKENS[:39])
        assert match.prefix_len == 0  # nowhere is the SWA tail: no hit
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_host_match_stops_where_its_swa_tail_exists() -> None:
    with pool_of("write_back") as pool:
        run(pool, "a", TOKENS[:20])
        pool.evict(pool.capacity)  # node A (20 tokens) backed up with its SWA KV
        run(pool, "c", TOKENS)  # A back on the device (c's pages), node B below it
        pool.evict_swa(pool.swa_capacity)  # every device page tombstoned
        pool.evict(pool.capacity)  # B backed up now: full KV alone; A keeps its copy
        assert pool.tree.tier_tokens()["host_only"] == 40
        poison(pool)
        pool.check_integrity()
        pool.open_request("b")
        match = pool.match_prefix_tiers("b", TOKENS[:39])
        assert match.prefix_len == 20 and match.host_tokens == 20  # A's SWA tail, not B's
        pool.wait_loaded("b")
        full, swa = read_hit(pool, "b", 20)
        assert full == [value(p, False) for p in range(20)]
        assert swa == [value(p, True) for p in range(8, 20)]
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_device_prefix_keeps_the_match_rule_when_the_host_part_is_not_loaded() -> None:
    with pool_of("write_back") as pool:
        run(pool, "a", TOKENS)
        pool.open_request("b")
        match = pool.match_prefix_tiers("b", TOKENS[:39])
        assert match.prefix_len == 36 and match.host_tokens == 0  # on the device
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_victim_retracted_into_the_tree_comes_back_with_its_swa_tail() -> None:
    with pool_of("write_back") as pool:
        rows = []
        for rid, base in (("a", 0), ("v", 500)):
            rows.append(pool.open_request(rid))
            slots = pool.alloc_extend([(rid, 30)])
            f2s = pool.buffers.full_to_swa_page
            for pos, slot in enumerate(slots.tolist()):
                pool.buffers.kv[slot // PS, :, :, slot % PS] = value(base + pos, False)
                pool.buffers.swa_kv[f2s[slot // PS], :, :, slot % PS] = value(base + pos, True)
        victim_tokens = list(range(500, 530))
        result = pool.retract(rows, offload=False, retract_decode_steps=1,
                              to_tree={rows[1]: victim_tokens})  # fmt: skip
        assert result.to_tree == ["v"] and result.tree_bytes > 0
        pool.release("a", is_insert=False)
        pool.evict(pool.capacity)  # the victim's KV is on the host tier alone
        poison(pool)
        pool.check_integrity()
        pool.open_request("v2")
        match = pool.match_prefix_tiers("v2", victim_tokens)
        assert match.prefix_len == 28 and match.host_tokens == 28
        pool.wait_loaded("v2")
        full, swa = read_hit(pool, "v2", 28)
        assert full == [value(500 + p, False) for p in range(28)]
        assert swa == [value(500 + p, True) for p in range(16, 28)]
        pool.release("v2", is_insert=False)
        pool.check_integrity(idle=True)


def test_a_pure_swa_pool_refuses_the_storage_tier(tmp_path) -> None:
    """Storage copies keep full KV alone: a pure sliding-window model has none."""
    with pytest.raises(InvalidArgumentError, match="storage tier"):
        pool_of(layer_types=PURE, storage_dir=tmp_path / "store")


def test_a_pure_swa_host_hit_costs_its_swa_bytes() -> None:
    """The host tier of a pure sliding-window pool is sized by SWA bytes; a load copies
    (and the cost model prices) the SWA pages its host copy holds, no full bytes."""
    with pool_of("write_back", layer_types=PURE) as pool:
        tree = pool.tree
        swa_page = swa_pool_layout(pool.layout).bytes_per_page
        assert pool.layout.bytes_per_page == 0 and tree.host.num_pages == 32
        run(pool, "a", TOKENS)
        pool.evict(pool.capacity)
        assert tree.stats.backup_bytes == 10 * swa_page  # its 10 SWA pages, no full bytes
        path, _ = tree._walk(tree._as_key(TOKENS[:36]))  # (splits the node at 36)
        assert tree._load_bytes(path) == 9 * swa_page
        before = tree.stats.load_bytes
        pool.open_request("b")
        assert pool.match_prefix_tiers("b", TOKENS[:39]).host_tokens == 36
        pool.wait_loaded("b")
        assert tree.stats.load_bytes - before == 9 * swa_page
        assert tree.stats_dict()["swa_host_used_bytes"] == 10 * swa_page
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)
        pool.flush_cache()
        pool.check_integrity(idle=True)
        assert tree.swa_host.used_pages == 0 and tree.host.used_pages == 0


def test_a_storage_only_node_is_not_a_hit(tmp_path) -> None:
    with pool_of("write_back", storage_dir=tmp_path / "store") as pool:
        run(pool, "a", TOKENS)
        pool.evict(pool.capacity)
        pool.tree.evict_host(pool.tree.host.num_pages)  # demoted to storage: full KV only
        assert pool.tree.tier_tokens()["storage_only"] == 40
        pool.open_request("b")
        match = pool.match_prefix_tiers("b", TOKENS[:39])
        assert match.prefix_len == 0
        pool.release("b", is_insert=False)
        pool.check_integrity(idle=True)
        pool.flush_cache()
        pool.check_integrity(idle=True)
        np.testing.assert_equal(pool.tree.swa_host.used_pages, 0)


# -- the hybrid pool's property test, over the hierarchical cache ---------------------------


class SWAHiCacheMachine(SWAPoolMachine):
    """:class:`SWAPoolMachine` on a hybrid pool with the hierarchical cache: device
    eviction moves nodes to the host tier (with their SWA KV where they hold it), the
    host tier evicts too, and a match loads host nodes back; the worker's reads (every
    full position, the SWA window) are checked after every step."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 12),
        swa_tokens=st.sampled_from([24, 48, 96]),
        policy=st.sampled_from(["write_through", "write_back"]),
        pure=st.booleans(),
    )
    def setup(self, page_size: int, window: int, swa_tokens: int, policy: str, pure: bool) -> None:
        layout = hybrid_pool_layout(page_size, window, swa_tokens // page_size, pure=pure)
        config = HiCacheConfig(
            size_bytes=(256 // page_size) * host_page_bytes(layout),
            write_policy=policy,
            disable_load_cost_model=True,
        )
        self.pool = KVPool(layout, hicache=config, host_store_bytes=1 << 20)
        self.window = window
        self.seqs = {}
        self.starts = {}
        self.reserved = set()
        self.tried = set()
        self.counter = 0
        self.released: list[list[int]] = []  # the KV'd tokens of requests released to the tree

    @precondition(lambda self: self.pool.table.available_size() > 0)
    @rule(
        target=SWAPoolMachine.open_rids,
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
        self.pool.wait_loaded(rid)
        self.expect_kv(rid)
        # and computes its prompt at once (when it fits), so released requests hold KV
        slots = self.pool.alloc_extend([(rid, prompt_len - hit)])
        if slots is not None:
            self.starts[rid].append(hit)
            self.write_kv(rid, hit, slots)
        return rid

    @rule(rid=consumes(SWAPoolMachine.open_rids), is_insert=st.booleans())
    def release(self, rid: str, is_insert: bool) -> None:
        kv_len = self.pool.request(rid).kv_len
        self.pool.release(rid, self.seqs[rid][:kv_len], is_insert=is_insert)
        if is_insert and kv_len:
            self.released.append(self.seqs[rid][:kv_len])

    @precondition(lambda self: self.pool.table.available_size() > 0 and self.released)
    @rule(target=SWAPoolMachine.open_rids, data=st.data())
    def open_released(self, data):
        """A request that continues a released one: its whole KV is a match if its
        SWA tail is held somewhere (device or host), loaded back from the host."""
        tokens = data.draw(st.sampled_from(self.released))
        self.counter += 1
        rid = f"r{self.counter}"
        self.seqs[rid] = tokens + list(range(300, 330))
        self.pool.open_request(rid)
        self.starts[rid] = []
        self.pool.match_prefix(rid, tokens)
        self.pool.wait_loaded(rid)
        self.expect_kv(rid)
        return rid

    @rule(num_pages=st.integers(0, 16))
    def evict_host(self, num_pages: int) -> None:
        self.pool.tree.evict_host(num_pages)


def hybrid_pool_layout(page_size: int, window: int, swa_pages: int, *, pure=False) -> PoolLayout:
    return PoolLayout(
        num_layers=3,
        layer_types=(S, S, S) if pure else (S, F, S),
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


SWAHiCacheMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSWAHiCacheProperties = SWAHiCacheMachine.TestCase
