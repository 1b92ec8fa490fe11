"""The hierarchical cache (HiRadixCache in a KVPool): tiers, write policies, loads, storage.

Each request's KV is written as a function of (token id, position), so a prefix
that comes back from the host or storage tier can be checked value by value.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from memsvc.core import KVPool, PoolLayout
from memsvc.core.errors import InvalidArgumentError, PrefixCutError
from memsvc.core.hicache import LOAD_BACK_THRESHOLD, HiCacheConfig, HiRadixCache
from memsvc.core.radix_cache import RadixCache
from memsvc.core.storage.file import SUFFIX

PAGE = 4


def layout(num_pages: int = 8) -> PoolLayout:
    return PoolLayout(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PAGE,
        num_pages=num_pages,
        dtype="float32",
        max_running_requests=8,
        max_context_len=128,
    )


def make_pool(
    tmp_path=None,
    *,
    num_pages: int = 8,
    host_pages: int = 8,
    policy: str = "write_through",
    storage: str | None = None,
    storage_pages: int = 16,
) -> KVPool:
    lay = layout(num_pages)
    config = HiCacheConfig(
        size_bytes=host_pages * lay.bytes_per_page,
        write_policy=policy,
        storage_backend=storage,
        storage_dir=str(tmp_path / "store") if tmp_path is not None else "/nonexistent",
        storage_size_bytes=storage_pages * lay.bytes_per_page,
    )
    return KVPool(lay, hicache=config)


def kv_of(tokens: np.ndarray, start: int, shape: tuple[int, ...]) -> np.ndarray:
    """KV of positions ``start..`` of ``tokens``: every element ``token * 256 + position``."""
    values = tokens[start:] * 256 + np.arange(start, len(tokens))
    return np.broadcast_to(
        values.astype(np.float32)[:, None, None, None, None], (len(values), *shape)
    ).copy()


def kv_shape(pool: KVPool) -> tuple[int, ...]:
    shape = pool.layout.kv_shape
    return (shape[1], shape[2], shape[4], shape[5])


def run_request(pool: KVPool, rid: str, tokens: np.ndarray, *, release: bool = True):
    """Match, check the matched prefix's KV, extend, write its KV, finish (insert)."""
    pool.open_request(rid)
    match = pool.match_prefix_tiers(rid, tokens[:-1])
    slots = pool.alloc_extend([(rid, len(tokens) - match.prefix_len)])
    assert slots is not None, f"{rid} does not fit"
    kv = pool.buffers.read_slots(pool.slots(rid, 0, match.prefix_len))
    np.testing.assert_array_equal(kv, kv_of(tokens[: match.prefix_len], 0, kv_shape(pool)))
    pool.buffers.write_slots(slots, kv_of(tokens, match.prefix_len, kv_shape(pool)))
    if release:
        pool.release(rid, tokens)
    pool.check_integrity()
    return match


def seq(seed: int, pages: int, tail: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 200, size=pages * PAGE + tail)


def finish(pool: KVPool) -> None:
    pool.settle_copies()
    pool.check_integrity(idle=True)
    pool.close()


def test_flag_off_is_todays_radix_cache():
    pool = KVPool(layout())
    assert type(pool.tree) is RadixCache and pool.hicache is None
    tokens = seq(0, 3)
    run_request(pool, "a", tokens)
    pool.open_request("b")
    match = pool.match_prefix_tiers("b", tokens[:-1])
    assert (match.prefix_len, match.device_tokens, match.host_tokens) == (12, 12, 0)
    pool.release("b", is_insert=False)
    pool.evict(pool.evictable_size())
    pool.open_request("c")
    assert pool.match_prefix("c", tokens[:-1]) == 0  # evicted KV is gone without the hierarchy
    pool.release("c", is_insert=False)
    finish(pool)


def test_hicache_rejects_disabled_radix_cache():
    with pytest.raises(InvalidArgumentError, match="needs the radix cache"):
        KVPool(layout(), disable_radix_cache=True, hicache=HiCacheConfig())


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefix_comes_back_from_host(policy):
    pool = make_pool(policy=policy)
    tree = pool.hicache
    tokens = seq(1, 3)
    run_request(pool, "a", tokens)
    pool.settle_copies()
    # write_through copied on insert; write_back copies only at eviction
    assert tree.host_used_tokens() == (12 if policy == "write_through" else 0)
    assert pool.evict(12) == 12
    assert pool.evictable_size() == 0 and tree.host_used_tokens() == 12
    assert tree.tier_tokens() == {"device": 0, "host_only": 12, "storage_only": 0}
    match = run_request(pool, "b", tokens)
    assert (match.prefix_len, match.device_tokens, match.host_tokens) == (12, 0, 12)
    assert tree.stats.hit_tokens["host"] == 12
    assert tree.stats.load_bytes == 3 * pool.layout.bytes_per_page
    finish(pool)


def test_write_through_selective_backs_up_after_the_threshold_hit():
    pool = make_pool(policy="write_through_selective")
    tree = pool.hicache
    hot, cold = seq(2, 3), seq(3, 3)
    run_request(pool, "hot0", hot)
    run_request(pool, "cold0", cold)
    assert tree.host_used_tokens() == 0
    run_request(pool, "hot1", hot)  # hit 1
    assert tree.host_used_tokens() == 0
    run_request(pool, "hot2", hot)  # hit 2: SGLang's threshold
    assert tree.host_used_tokens() == 12
    pool.evict(pool.evictable_size())
    assert tree.stats.dropped_tokens == 12  # the cold node had no host copy
    assert run_request(pool, "hot3", hot).host_tokens == 12
    assert run_request(pool, "cold1", cold).prefix_len == 0
    finish(pool)


def test_shared_prefix_and_partial_host_path():
    pool = make_pool(num_pages=12, host_pages=16)
    base = seq(4, 2, tail=0)
    a = np.concatenate([base, seq(5, 2)])
    b = np.concatenate([base, seq(6, 3)])
    run_request(pool, "a", a)
    run_request(pool, "b", b)
    pool.evict(4)  # b's own leaf (older) goes first... or a's: whichever, one leaf
    pool.evict(pool.evictable_size())
    m = run_request(pool, "a2", a)
    assert m.prefix_len == 16 and m.host_tokens == 16
    m = run_request(pool, "b2", b)  # the shared base is on the device now
    assert (m.device_tokens, m.host_tokens) == (8, 12)
    finish(pool)


def num_nodes(pool: KVPool) -> int:
    return sum(1 for _ in pool.hicache.iter_nodes())


def test_a_host_hit_under_the_load_back_threshold_is_recomputed():
    """SGLang's load_back_threshold (10, hard-coded in HiRadixCache): an 8-token host hit is
    not loaded; the match stops at the device prefix and the request recomputes it."""
    assert LOAD_BACK_THRESHOLD == 10
    pool = make_pool()
    tree = pool.hicache
    base = seq(120, 2)
    run_request(pool, "a", base)
    pool.evict(pool.evictable_size())
    assert tree.tier_tokens() == {"device": 0, "host_only": 8, "storage_only": 0}
    m = run_request(pool, "b", base)  # recomputed, and inserted again over its host copy
    assert (m.prefix_len, m.host_tokens) == (0, 0)
    assert tree.stats.load_tokens == 0 and tree.stats.hit_tokens["host"] == 0
    # 8 device tokens, then an 8-token host tail: the tail is recomputed
    longer = np.concatenate([base[:8], seq(121, 2)])
    run_request(pool, "c", longer)
    assert pool.evict(1) == 8  # c's own leaf, the only device leaf
    m = run_request(pool, "d", longer)
    assert (m.prefix_len, m.device_tokens, m.host_tokens) == (8, 8, 0)
    assert tree.stats.load_tokens == 0
    # 12 tokens (>= 10) are loaded
    pool.evict(pool.evictable_size())
    m = run_request(pool, "e", np.concatenate([longer[:12], [7]]))
    assert (m.prefix_len, m.host_tokens) == (12, 12)
    finish(pool)


def test_a_host_hit_the_device_cannot_take_whole_is_not_loaded():
    """SGLang loads a host hit all or nothing: a 16-token hit with 4 free device tokens and
    nothing evictable loads nothing (no node split, no page taken), and the whole of it
    once the device has room."""
    pool = make_pool(num_pages=8, host_pages=16)
    tree = pool.hicache
    tokens = seq(7, 4)
    run_request(pool, "a", tokens)
    pool.evict(pool.evictable_size())
    pool.open_request("hold")
    assert pool.alloc_extend([("hold", 7 * PAGE)]) is not None
    assert (pool.available_size(), pool.evictable_size()) == (PAGE, 0)
    nodes = num_nodes(pool)
    pool.open_request("b")
    match = pool.match_prefix_tiers("b", tokens[:-1])
    assert (match.prefix_len, match.host_tokens, match.load_pending) == (0, 0, False)
    assert pool.available_size() == PAGE and num_nodes(pool) == nodes
    assert tree.tier_tokens()["host_only"] == 16 and tree.stats.load_tokens == 0
    pool.check_integrity()
    pool.release("b", is_insert=False)
    pool.release("hold", is_insert=False)
    m = run_request(pool, "c", tokens)
    assert (m.prefix_len, m.host_tokens) == (16, 16)
    finish(pool)


def test_a_storage_hit_follows_the_same_rules(tmp_path):
    """Storage-tier hits load the same way (SGLang's storage pages reach the device through
    its host load-back): under 10 tokens, or more than the device can take, nothing loads."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tree = pool.hicache
    short, long = seq(122, 2), seq(123, 4)
    for rid, tokens in (("s", short), ("l", long)):
        run_request(pool, rid, tokens)
    pool.evict(pool.evictable_size())
    tree.evict_host(tree.host.num_pages)
    assert tree.tier_tokens() == {"device": 0, "host_only": 0, "storage_only": 24}
    assert run_request(pool, "s2", short).prefix_len == 0
    pool.evict(pool.evictable_size())
    tree.evict_host(tree.host.num_pages)
    pool.open_request("hold")
    assert pool.alloc_extend([("hold", 7 * PAGE)]) is not None
    pool.open_request("l2")
    assert pool.match_prefix_tiers("l2", long[:-1]).prefix_len == 0
    assert tree.tier_tokens()["storage_only"] == 24 and tree.stats.load_tokens == 0
    pool.release("l2", is_insert=False)
    pool.release("hold", is_insert=False)
    m = run_request(pool, "l3", long)
    assert (m.prefix_len, m.storage_tokens) == (16, 16)
    finish(pool)


def test_host_lru_drops_leaves_without_storage():
    pool = make_pool(num_pages=8, host_pages=3)
    a, b = seq(8, 2), seq(9, 2)
    run_request(pool, "a", a)
    run_request(pool, "b", b)  # host full: a's host copy (LRU) goes
    pool.settle_copies()
    assert pool.hicache.host_used_tokens() == 8
    pool.evict(pool.evictable_size())
    assert run_request(pool, "a2", a).prefix_len == 0
    finish(pool)


def test_storage_tier_demotes_and_reads_back(tmp_path):
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", storage_pages=16)
    tree = pool.hicache
    a, b, c = seq(10, 3), seq(11, 3), seq(12, 3)
    for rid, tokens in (("a", a), ("b", b), ("c", c)):
        run_request(pool, rid, tokens)
    pool.evict(pool.evictable_size())  # device -> host; host LRU -> storage
    pool.settle_copies()
    files = [n for n in os.listdir(tree.storage.directory) if n.endswith(SUFFIX)]
    assert len(files) == tree.storage_used_bytes() // pool.layout.bytes_per_page >= 3
    m = run_request(pool, "a2", a)
    assert (m.prefix_len, m.storage_tokens) == (12, 12)
    assert tree.stats.hit_tokens["storage"] == 12
    finish(pool)


def test_storage_cap_evicts_lru(tmp_path):
    pool = make_pool(tmp_path, num_pages=8, host_pages=3, storage="file", storage_pages=6)
    seqs = [seq(20 + i, 3) for i in range(5)]
    for i, tokens in enumerate(seqs):
        run_request(pool, f"r{i}", tokens)
        pool.evict(pool.evictable_size())
    tree = pool.hicache
    assert tree.storage_used_bytes() <= 6 * pool.layout.bytes_per_page
    assert run_request(pool, "last", seqs[-1]).prefix_len == 12  # newest kept
    assert run_request(pool, "first", seqs[0]).prefix_len == 0  # oldest dropped
    finish(pool)


def test_restart_reads_nothing_a_previous_memsvc_left(tmp_path):
    """Each cache keeps its pages in a fresh subdirectory of its own and removes it on
    close: a new memsvc over the same directory never sees (nor deletes) anything else."""
    store = tmp_path / "store"
    store.mkdir()
    (store / ("stale" + SUFFIX)).write_bytes(b"x" * 10)
    (store / "unrelated.txt").write_text("keep me")
    pool = make_pool(tmp_path, storage="file")
    own = pool.hicache.storage.directory
    assert os.path.dirname(own) == str(store) and os.listdir(own) == []
    tokens = seq(30, 2)
    run_request(pool, "a", tokens)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(pool.hicache.host.num_pages)
    pool.settle_copies()
    assert any(n.endswith(SUFFIX) for n in os.listdir(own))
    finish(pool)
    assert sorted(os.listdir(store)) == ["stale" + SUFFIX, "unrelated.txt"]
    pool = make_pool(tmp_path, storage="file")
    assert pool.hicache.storage.directory != own
    assert run_request(pool, "b", tokens).prefix_len == 0
    finish(pool)
    assert sorted(os.listdir(store)) == ["stale" + SUFFIX, "unrelated.txt"]


def test_storage_dir_unusable_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    lay = layout()
    with pytest.raises(InvalidArgumentError, match="unusable"):
        KVPool(lay, hicache=HiCacheConfig(storage_backend="file", storage_dir=str(blocker)))


def test_nixl_posix_storage_round_trip(tmp_path):
    pytest.importorskip("nixl_cu12")
    pool = make_pool(tmp_path, num_pages=8, host_pages=3, storage="nixl")
    assert pool.hicache.storage.name == "nixl"
    a, b = seq(40, 3), seq(41, 3)
    run_request(pool, "a", a)
    run_request(pool, "b", b)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(3)
    assert run_request(pool, "a2", a).storage_tokens == 12
    finish(pool)


class SlowCopies:
    """Holds every hicache copy job until released: a load or write-back still in flight."""

    def __init__(self, pool: KVPool) -> None:
        self.gate = threading.Event()
        real = pool.buffers.submit

        def submit(fn, *args):
            def held(*a):
                assert self.gate.wait(10), "a copy was waited for before its gate opened"
                fn(*a)

            return real(held, *args)

        pool.buffers.submit = submit


def test_load_is_fenced_until_alloc_extend():
    pool = make_pool()
    tokens = seq(50, 3)
    run_request(pool, "a", tokens)
    pool.evict(pool.evictable_size())
    pool.settle_copies()
    pool.buffers.kv[...] = 0  # the freed pages must not still hold a's KV by chance
    slow = SlowCopies(pool)
    pool.open_request("b")
    match = pool.match_prefix_tiers("b", tokens[:-1])
    assert match.host_tokens == 12 and match.load_pending
    kv = pool.buffers.read_slots(pool.slots("b"))
    assert not np.array_equal(kv, kv_of(tokens[:12], 0, kv_shape(pool)))  # not copied yet
    threading.Timer(0.2, slow.gate.set).start()
    started = time.perf_counter()
    assert pool.alloc_extend([("b", 1)]) is not None  # waits for the load
    assert time.perf_counter() - started >= 0.15
    kv = pool.buffers.read_slots(pool.slots("b", 0, 12))
    np.testing.assert_array_equal(kv, kv_of(tokens[:12], 0, kv_shape(pool)))
    pool.release("b", is_insert=False)
    finish(pool)


def test_load_racing_eviction_and_host_reuse_loses_nothing():
    """A request gives up its loading prefix; the tree evicts it and reuses its host
    pages for another backup while the load is still running: every copy lands right."""
    pool = make_pool(num_pages=6, host_pages=3)
    a, b = seq(60, 3), seq(61, 3)
    run_request(pool, "a", a)
    pool.evict(pool.evictable_size())
    pool.settle_copies()
    slow = SlowCopies(pool)
    pool.open_request("x")
    assert pool.match_prefix_tiers("x", a[:-1]).load_pending
    pool.release("x", is_insert=False)  # gives the loading prefix up
    pool.evict(pool.evictable_size())  # its device pages: pending behind the load
    assert pool.allocator.num_pending_pages == 3
    pool.check_integrity()
    # b needs every device page and a's host pages (write_through): all wait their turn
    pool.open_request("b")
    pool.match_prefix_tiers("b", b[:-1])
    threading.Timer(0.2, slow.gate.set).start()
    started = time.perf_counter()
    slots = pool.alloc_extend([("b", len(b))])  # waits for the load to free its pages
    assert time.perf_counter() - started >= 0.15
    pool.check_integrity()
    pool.buffers.write_slots(slots, kv_of(b, 0, kv_shape(pool)))
    pool.release("b", b)
    pool.evict(pool.evictable_size())
    m = run_request(pool, "b2", b)
    assert m.host_tokens == 12
    finish(pool)


def test_write_back_racing_a_free():
    """write_back: eviction copies device -> host and frees the pages at once; they
    are handed out again only after the copy read them."""
    pool = make_pool(num_pages=4, host_pages=6, policy="write_back")
    a = seq(70, 3)
    run_request(pool, "a", a)
    slow = SlowCopies(pool)
    pool.open_request("b")
    assert pool.match_prefix_tiers("b", seq(71, 4)[:-1]).prefix_len == 0
    threading.Timer(0.2, slow.gate.set).start()
    slots = pool.alloc_extend([("b", 16)])  # evicts a (write-back), waits, reuses its pages
    assert slots is not None
    pool.buffers.write_slots(slots, np.zeros((16, *kv_shape(pool)), np.float32))
    pool.release("b", is_insert=False)
    m = run_request(pool, "a2", a)
    assert m.host_tokens == 12  # the host copy holds a's KV (checked), not b's zeros
    finish(pool)


def _decode_batch(pool: KVPool, names: list[str], seqs: list[np.ndarray]) -> list[int]:
    rows = []
    for name, tokens in zip(names, seqs, strict=True):
        run_request(pool, name, tokens, release=False)
        rows.append(pool.request(name).row)
    return rows


def test_retract_victim_into_tree_is_found_on_readmission():
    pool = make_pool(num_pages=7, host_pages=16, policy="write_back")
    a, b = seq(80, 3, tail=0), seq(81, 3, tail=0)
    rows = _decode_batch(pool, ["a", "b"], [a, b])
    assert pool.available_size() == 4  # 6 pages used of 7
    before = pool.hicache.host_used_tokens()
    result = pool.retract(rows, offload=False, retract_decode_steps=4, to_tree={rows[1]: b})
    assert result.retracted == ["b"] and result.to_tree == ["b"]
    assert result.tree_bytes == 3 * pool.layout.bytes_per_page
    assert pool.hicache.host_used_tokens() == before + 12
    pool.release("a", a)
    pool.evict(pool.evictable_size())
    # b's re-admission (its committed tokens + the next one) hits all of its KV
    m = run_request(pool, "b-again", np.concatenate([b, [5]]))
    assert m.prefix_len == 12 and m.host_tokens + m.device_tokens == 12
    finish(pool)


def test_retract_into_tree_bad_tokens_change_nothing():
    pool = make_pool(num_pages=7)
    a, b = seq(82, 3, tail=0), seq(83, 3, tail=0)
    rows = _decode_batch(pool, ["a", "b"], [a, b])
    with pytest.raises(InvalidArgumentError):  # (one short: a decode slot reserved ahead,
        # given back, tests/core/test_decode_reservation.py; two short is a bad length)
        pool.retract(rows, offload=False, retract_decode_steps=4, to_tree={rows[1]: b[:-2]})
    assert pool.open_rids() == ["a", "b"]
    pool.check_integrity()
    plain = KVPool(layout(7))
    rows2 = _decode_batch(plain, ["a", "b"], [a, b])
    with pytest.raises(InvalidArgumentError, match="hierarchical cache"):
        plain.retract(rows2, offload=False, retract_decode_steps=4, to_tree={rows2[1]: b})
    for p in (pool, plain):
        p.release("a", is_insert=False)
        p.release("b", is_insert=False)
        finish(p)


def test_insert_over_host_nodes_adopts_the_callers_pages():
    """A request that recomputed a host-only prefix (no room to load) puts it back on the
    device: the tree takes its pages, the host copy stays, nothing is doubled."""
    pool = make_pool(num_pages=4, host_pages=8)
    tokens = seq(90, 3)
    run_request(pool, "a", tokens)
    pool.evict(pool.evictable_size())
    pool.open_request("hold")
    pool.alloc_extend([("hold", 4 * PAGE)])
    pool.open_request("b")
    assert pool.match_prefix_tiers("b", tokens[:-1]).prefix_len == 0  # no room to load
    pool.release("hold", is_insert=False)
    slots = pool.alloc_extend([("b", len(tokens))])
    pool.buffers.write_slots(slots, kv_of(tokens, 0, kv_shape(pool)))
    pool.release("b", tokens)
    tree: HiRadixCache = pool.hicache
    assert tree.tier_tokens() == {"device": 12, "host_only": 0, "storage_only": 0}
    assert tree.host_used_tokens() == 12
    pool.check_integrity()
    finish(pool)


def _lose_storage_pages(tmp_path, pool: KVPool, tokens: np.ndarray) -> None:
    """Put ``tokens``' prefix only in the storage tier, then delete its page files."""
    run_request(pool, "writer", tokens)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(pool.hicache.host.num_pages)
    pool.settle_copies()
    assert pool.hicache.tier_tokens()["storage_only"] == len(tokens) - 1
    directory = pool.hicache.storage.directory
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))


def two_holders_of_one_load(pool: KVPool, tokens: np.ndarray) -> None:
    """Requests "a" and "b" match ``tokens``' 12-token storage-only prefix while its load
    is held back (b shares a's load); then the load runs and ends."""
    slow = SlowCopies(pool)
    pool.open_request("a")
    pool.open_request("b")
    assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 12
    assert pool.match_prefix_tiers("b", tokens[:-1]).prefix_len == 12
    slow.gate.set()
    pool.settle_copies()


def test_failed_storage_load_cuts_the_prefix_of_its_holders(tmp_path):
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tokens = seq(100, 3)
    _lose_storage_pages(tmp_path, pool, tokens)
    two_holders_of_one_load(pool, tokens)
    with pytest.raises(PrefixCutError, match="failed to load") as cut:
        pool.alloc_extend([("a", 1)])
    assert cut.value.cut == {"a": 0}  # every page was lost: nothing of it is kept
    for rid in ("a", "b"):  # both holders hold nothing now; the prefix is gone
        assert pool.request(rid).kv_len == 0
    pool.check_integrity()
    assert pool.hicache.tier_tokens() == {"device": 0, "host_only": 0, "storage_only": 0}
    pool.release("b", is_insert=False)  # b leaves before it is told
    slots = pool.alloc_extend([("a", len(tokens))])  # a recomputes from scratch
    pool.buffers.write_slots(slots, kv_of(tokens, 0, kv_shape(pool)))
    pool.release("a", tokens)
    assert run_request(pool, "again", tokens).device_tokens == 12
    finish(pool)


def test_failed_load_nobody_waited_for_is_never_served(tmp_path):
    """The loading request leaves before its alloc_extend; the next match (or an eviction)
    finds the failed load and drops the node instead of serving or backing up its pages."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", policy="write_back")
    tokens = seq(101, 3)
    _lose_storage_pages(tmp_path, pool, tokens)
    slow = SlowCopies(pool)  # the load is still in flight when the match returns
    pool.open_request("a")
    assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 12
    pool.release("a", is_insert=False)
    slow.gate.set()
    pool.settle_copies()
    assert run_request(pool, "b", tokens).prefix_len == 0  # dropped, recomputed
    pool.check_integrity()
    # the eviction path: lose the pages again, leave, evict (write_back would copy it)
    _lose_storage_pages(tmp_path, pool, tokens)
    pool.open_request("c")
    pool.match_prefix_tiers("c", tokens[:-1])
    pool.release("c", is_insert=False)
    pool.settle_copies()
    backups = pool.hicache.stats.backup_bytes
    pool.evict(pool.evictable_size())
    assert pool.hicache.stats.backup_bytes == backups  # nothing copied from the failed load
    assert run_request(pool, "d", tokens).prefix_len == 0
    finish(pool)


def test_host_tier_sizing_and_config_errors():
    lay = layout(10)
    with KVPool(lay, hicache=HiCacheConfig()) as pool:
        assert pool.hicache.host.num_pages == 20  # --hicache-ratio 2.0 x 10 device pages
    pool = KVPool(lay, hicache=HiCacheConfig(ratio=2.0, size_bytes=3 * lay.bytes_per_page))
    assert pool.hicache.host.num_pages == 3  # --hicache-size wins
    assert pool.hicache.storage is None and pool.hicache.storage_capacity_pages == 0
    pool.close()
    with pytest.raises(InvalidArgumentError, match="write policy"):
        HiCacheConfig(write_policy="sometimes")
    with pytest.raises(InvalidArgumentError, match="ratio"):
        HiCacheConfig(ratio=0)


def test_private_host_entries_work_beside_the_hierarchy():
    """PD decode's retract path (offload / load of a private host-store entry, asynchronous)
    shares the copy thread with the tiers and keeps working as without them."""
    lay = layout(8)
    pool = KVPool(
        lay,
        host_store_bytes=lay.kv_bytes,
        async_offload=True,
        hicache=HiCacheConfig(size_bytes=8 * lay.bytes_per_page),
    )
    shared = seq(110, 3, tail=0)
    run_request(pool, "warm", np.concatenate([shared, [1]]))  # in the tree, write-through
    tokens = np.concatenate([shared, seq(111, 1)])
    run_request(pool, "r", tokens, release=False)
    before = pool.buffers.read_slots(pool.slots("r"))
    pool.offload("r")
    pool.release("r", is_insert=False)
    pool.evict(pool.evictable_size())  # the shared prefix goes to the host tier
    pool.open_request("r")
    slots = pool.load("r")
    np.testing.assert_array_equal(pool.buffers.read_slots(slots), before)
    pool.release("r", is_insert=False)
    assert run_request(pool, "other", np.concatenate([shared, [2]])).host_tokens == 12
    finish(pool)


def test_flush_cache_empties_every_tier_but_the_locked_path(tmp_path):
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", storage_pages=16)
    tree = pool.hicache
    a, b, c = seq(30, 2), seq(31, 2), seq(32, 2)
    for rid, tokens in (("a", a), ("b", b), ("c", c)):
        run_request(pool, rid, tokens)
    pool.evict(pool.evictable_size())  # device -> host -> storage
    run_request(pool, "held", c, release=False)  # c's path is locked on the device
    pool.settle_copies()
    assert tree.storage_used_bytes() > 0 and tree.host_used_tokens() > 0
    pool.flush_cache()
    pool.settle_copies()
    assert tree.host_used_tokens() == 0 and tree.storage_used_bytes() == 0
    assert not [n for n in os.listdir(tree.storage.directory) if n.endswith(SUFFIX)]
    pool.check_integrity()
    pool.open_request("a2")
    assert pool.match_prefix_tiers("a2", a[:-1]).prefix_len == 0  # gone from every tier
    pool.release("a2", is_insert=False)
    pool.release("held", c)
    finish(pool)
