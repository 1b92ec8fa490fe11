"""Cache namespaces (issue 30): two requests share cached KV only if their namespaces are
equal, in every tree (radix, hierarchical, SWA, SWA hierarchical) and every tier (device,
host, storage), on retract into the tree too; the default namespace is unchanged;
per-namespace flush; the per-namespace cap (--max-cached-tokens-per-salt); per-namespace
counters and stats. Every test ends with the pool's idle integrity check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from memsvc.core import KVPool, PoolLayout
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.hicache import HiCacheConfig
from memsvc.core.storage.chain import page_hash_chain
from memsvc.namespace import DEFAULT_NAMESPACE, namespace_label, namespace_of

PAGE = 4
A = namespace_of("tenant-a", None)
B = namespace_of("tenant-b", None)
F, S = "full_attention", "sliding_attention"


def layout(num_pages: int = 32, *, hybrid: bool = False) -> PoolLayout:
    extra = {}
    if hybrid:
        extra = {"layer_types": (S, F), "sliding_window": 8, "swa_num_pages": num_pages}
    return PoolLayout(
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        page_size=PAGE,
        num_pages=num_pages,
        dtype="float32",
        max_running_requests=8,
        max_context_len=128,
        **extra,
    )


def hicache(lay: PoolLayout, tmp_path=None, *, host_pages: int = 32, **kw) -> HiCacheConfig:
    return HiCacheConfig(
        size_bytes=host_pages * max(lay.bytes_per_page, 1),
        write_policy=kw.pop("policy", "write_through"),
        disable_load_cost_model=True,
        storage_backend="file" if tmp_path is not None else None,
        storage_dir=str(tmp_path / "store") if tmp_path is not None else "/nonexistent",
        storage_size_bytes=64 * max(lay.bytes_per_page, 1),
        **kw,
    )


KINDS = ["radix", "hicache", "swa", "swa_hicache"]


def make_pool(kind: str = "radix", tmp_path=None, **kw) -> KVPool:
    hybrid = kind.startswith("swa")
    lay = layout(kw.pop("num_pages", 32), hybrid=hybrid)
    config = hicache(lay, tmp_path) if kind.endswith("hicache") else None
    return KVPool(lay, hicache=config, **kw)


def seq(seed: int, pages: int = 3, tail: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 500, size=pages * PAGE + tail)


def cache(pool: KVPool, rid: str, tokens: np.ndarray, namespace: str = DEFAULT_NAMESPACE) -> int:
    """A request in ``namespace``: match, extend, finish (insert). Returns its hit."""
    pool.open_request(rid, namespace)
    hit = pool.match_prefix(rid, tokens[:-1])
    assert pool.alloc_extend([(rid, len(tokens) - hit)]) is not None
    pool.release(rid, tokens)
    pool.check_integrity()
    return hit


def hit_of(pool: KVPool, rid: str, tokens: np.ndarray, namespace: str = DEFAULT_NAMESPACE):
    """The tiers a request in ``namespace`` would match; closes it again."""
    pool.open_request(rid, namespace)
    match = pool.match_prefix_tiers(rid, tokens[:-1])
    pool.wait_loaded(rid)
    pool.release(rid, is_insert=False)
    pool.check_integrity()
    return match


def finish(pool: KVPool) -> None:
    pool.settle_copies()
    pool.check_integrity(idle=True)
    pool.close()


# -- the device tree, in every kind of tree --------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_same_tokens_in_two_namespaces_never_share_a_node(kind):
    pool = make_pool(kind)
    tokens = seq(1)
    assert cache(pool, "a1", tokens, A) == 0
    assert hit_of(pool, "b", tokens, B).prefix_len == 0  # another tenant: a miss
    assert hit_of(pool, "d", tokens).prefix_len == 0  # the default namespace too
    assert hit_of(pool, "a2", tokens, A).prefix_len == 12  # the same tenant hits
    assert cache(pool, "b1", tokens, B) == 0  # B caches its own copy
    assert cache(pool, "d1", tokens) == 0
    assert pool.tree.namespace_tokens() == {A: 12, B: 12, DEFAULT_NAMESPACE: 12}
    a_pages = {int(s) // PAGE for s in pool.tree.match_prefix(tokens, A).slots}
    b_pages = {int(s) // PAGE for s in pool.tree.match_prefix(tokens, B).slots}
    assert len(a_pages) == 3 and a_pages.isdisjoint(b_pages)
    assert cache(pool, "b2", tokens, B) == 12
    finish(pool)


def test_the_default_namespace_is_unchanged():
    pool = make_pool()
    tokens = seq(2)
    assert cache(pool, "x", tokens) == 0
    assert cache(pool, "y", tokens) == 12
    # its nodes are filed under their first page alone, as before namespaces
    (edge,) = pool.tree.root.children
    assert edge == tokens[:PAGE].astype(np.int64).tobytes()
    assert pool.tree.namespace_tokens() == {DEFAULT_NAMESPACE: 12}
    finish(pool)


def test_a_running_request_publishes_into_its_own_namespace():
    pool = make_pool()
    tokens = seq(3)
    pool.open_request("a", A)
    pool.alloc_extend([("a", len(tokens))])
    assert pool.cache_unfinished("a", tokens) == 12
    assert hit_of(pool, "b", tokens, B).prefix_len == 0
    assert hit_of(pool, "a2", tokens, A).prefix_len == 12
    pool.release("a", tokens)
    finish(pool)


def test_a_tree_call_with_another_namespace_than_the_held_node_is_refused():
    pool = make_pool()
    tokens = seq(4)
    cache(pool, "a", tokens, A)
    match = pool.tree.match_prefix(tokens, A)
    pool.tree.lock(match.last_node)
    with pytest.raises(InvalidArgumentError, match="another cache namespace"):
        pool.tree.cache_finished_req(
            tokens[:12], match.slots, 12, match.last_node, is_insert=False, namespace=B
        )
    pool.tree.unlock(match.last_node)
    finish(pool)


@pytest.mark.parametrize("bad", ["X" * 32, "abc", "0" * 31, "g" * 32, 5, None])
def test_a_bad_namespace_is_refused_and_changes_nothing(bad):
    pool = make_pool()
    cache(pool, "a", seq(5), A)
    before = pool.tree.namespace_tokens()
    with pytest.raises(InvalidArgumentError, match="namespace"):
        pool.open_request("r", bad)
    assert not pool.is_open("r")
    if bad is not None:  # None: flush everything
        with pytest.raises(InvalidArgumentError, match="namespace"):
            pool.flush_cache(namespace=bad)
    assert pool.tree.namespace_tokens() == before
    finish(pool)


# -- the host and storage tiers -----------------------------------------------------


@pytest.mark.parametrize("kind", ["hicache", "swa_hicache"])
def test_the_host_tier_is_never_shared(kind):
    pool = make_pool(kind)
    tokens = seq(6)
    cache(pool, "a", tokens, A)
    pool.evict(pool.evictable_size())  # A's prefix lives on the host tier alone
    assert pool.hicache.tier_tokens()["host_only"] == 12
    miss = hit_of(pool, "b", tokens, B)
    assert (miss.prefix_len, miss.host_tokens) == (0, 0)
    assert hit_of(pool, "d", tokens).prefix_len == 0
    match = hit_of(pool, "a2", tokens, A)
    assert (match.prefix_len, match.host_tokens) == (12, 12)
    finish(pool)


def test_the_storage_tier_is_never_shared_and_each_chain_starts_from_its_seed(tmp_path):
    seeds = []

    def seed(namespace: str) -> str:
        seeds.append(namespace)
        return "seed-" + (namespace or "default")

    lay = layout()
    pool = KVPool(lay, hicache=hicache(lay, tmp_path), storage_seed=seed)
    tree = pool.hicache
    tokens = seq(7)
    cache(pool, "a", tokens, A)
    cache(pool, "b", tokens, B)
    pool.evict(pool.evictable_size())
    tree.evict_host(tree.host.num_pages)  # demoted: both copies in storage alone
    pool.settle_copies()
    assert tree.tier_tokens() == {"device": 0, "host_only": 0, "storage_only": 24}
    key = tokens[:12]
    assert tree._storage_keys == set(page_hash_chain("seed-" + A, key, PAGE)) | set(
        page_hash_chain("seed-" + B, key, PAGE)
    )
    assert A in seeds and B in seeds
    assert hit_of(pool, "d", tokens).prefix_len == 0
    match = hit_of(pool, "a2", tokens, A)
    assert (match.prefix_len, match.storage_tokens) == (12, 12)
    finish(pool)


@pytest.mark.parametrize("kind", ["hicache", "swa_hicache"])
def test_retract_into_the_tree_stays_in_the_victims_namespace(kind):
    pool = make_pool(kind)
    tokens = seq(8, pages=5, tail=0)
    rows = []
    for rid, ns in (("keep", B), ("victim", A)):
        rows.append(pool.open_request(rid, ns))
        pool.alloc_extend([(rid, 20)])
    result = pool.retract(rows, offload=False, retract_decode_steps=1, to_tree={rows[1]: tokens})
    assert result.to_tree == ["victim"]
    pool.release("keep", is_insert=False)
    pool.evict(pool.evictable_size())  # the victim's KV is on the host tier alone
    assert hit_of(pool, "b", tokens, B).prefix_len == 0
    assert hit_of(pool, "d", tokens).prefix_len == 0
    match = hit_of(pool, "a", tokens, A)
    assert match.prefix_len == 16 and match.host_tokens == 16
    finish(pool)


# -- per-namespace flush ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_flushing_one_namespace_leaves_the_others(kind, tmp_path):
    pool = make_pool(kind, tmp_path if kind == "hicache" else None)
    tokens, other = seq(9), seq(10)
    for ns in (A, B, DEFAULT_NAMESPACE):
        cache(pool, f"w{ns[:4]}", tokens, ns)
    cache(pool, "a-other", other, A)
    if pool.hicache is not None:
        pool.evict(12)  # one node off the device: the flush must reach the lower tiers
    assert pool.flush_cache(namespace=A) > 0
    assert A not in pool.tree.namespace_tokens()
    assert not [n for n in pool.tree.iter_nodes() if n.namespace == A]
    assert hit_of(pool, "a", tokens, A).prefix_len == 0
    assert hit_of(pool, "a", other, A).prefix_len == 0
    assert hit_of(pool, "b", tokens, B).prefix_len == 12
    assert hit_of(pool, "d", tokens).prefix_len == 12
    finish(pool)


def test_a_namespace_flush_drops_its_storage_pages_and_keeps_a_locked_path(tmp_path):
    lay = layout()
    pool = KVPool(lay, hicache=hicache(lay, tmp_path))
    tree = pool.hicache
    tokens = seq(11)
    cache(pool, "a", tokens, A)
    cache(pool, "b", tokens, B)
    pool.evict(pool.evictable_size())
    tree.evict_host(tree.host.num_pages)
    pool.open_request("running", A)  # A's prefix loaded back and locked
    assert pool.match_prefix("running", tokens[:-1]) == 12
    pool.wait_loaded("running")
    pool.flush_cache(namespace=A)
    pool.settle_copies()
    (locked,) = [n for n in tree.iter_nodes() if n.namespace == A]
    assert locked.lock_ref == 1 and locked.host_pages is None and not locked.on_disk
    assert len(tree._storage_keys) == 3  # B's pages alone
    assert tree.storage.keys() == tree._storage_keys
    pool.release("running", is_insert=False)
    assert hit_of(pool, "b", tokens, B).storage_tokens == 12
    finish(pool)


def test_flushing_the_default_namespace_alone():
    pool = make_pool()
    tokens = seq(12)
    cache(pool, "a", tokens, A)
    cache(pool, "d", tokens)
    assert pool.flush_cache(namespace=DEFAULT_NAMESPACE) == 12
    assert pool.tree.namespace_tokens() == {A: 12}
    finish(pool)


# -- the cap -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["radix", "hicache"])
def test_the_cap_evicts_only_the_namespace_over_it(kind):
    pool = make_pool(kind, max_cached_tokens_per_namespace=8)
    seqs = [seq(20 + i, pages=2) for i in range(4)]
    cache(pool, "b0", seqs[0], B)  # oldest of all: never A's to evict
    cache(pool, "d0", seqs[1])
    cache(pool, "d1", seqs[2])
    for i, tokens in enumerate(seqs):
        cache(pool, f"a{i}", tokens, A)
        assert pool.tree.namespace_tokens()[A] <= 8
    tokens_of = pool.tree.namespace_tokens()
    assert tokens_of == {A: 8, B: 8, DEFAULT_NAMESPACE: 16}
    assert set(pool.tree._ns_leaves) == {A, B}  # each capped namespace's own heap: no walk
    # A keeps its most recent prefix, LRU order within A
    assert hit_of(pool, "a-last", seqs[3], A).device_tokens == 8
    assert hit_of(pool, "a-first", seqs[0], A).device_tokens == 0
    assert hit_of(pool, "b", seqs[0], B).prefix_len == 8
    finish(pool)


def test_the_cap_never_evicts_a_locked_prefix_and_the_default_is_exempt():
    pool = make_pool(max_cached_tokens_per_namespace=8)
    first, second = seq(30, pages=2), seq(31, pages=2)
    pool.open_request("running", A)
    pool.alloc_extend([("running", len(first))])
    pool.cache_unfinished("running", first)  # 8 tokens of A, locked
    cache(pool, "a", second, A)  # 16 > 8: A's unlocked leaf goes, the locked one stays
    assert pool.tree.namespace_tokens()[A] == 8
    assert hit_of(pool, "a2", first, A).prefix_len == 8
    pool.release("running", first)
    for i in range(3):
        cache(pool, f"d{i}", seq(40 + i, pages=2))
    assert pool.tree.namespace_tokens()[DEFAULT_NAMESPACE] == 24
    finish(pool)


def test_setting_the_cap_later_builds_the_heaps():
    pool = make_pool()
    for i in range(3):
        cache(pool, f"a{i}", seq(50 + i, pages=2), A)
    pool.tree.set_namespace_cap(8)
    pool.check_integrity()
    cache(pool, "a3", seq(53, pages=2), A)
    assert pool.tree.namespace_tokens()[A] == 8
    finish(pool)


# -- counters and stats --------------------------------------------------------------------


def test_namespace_stats_count_cached_and_hit_tokens_per_tier_by_label():
    pool = make_pool("hicache")
    tokens = seq(60)
    cache(pool, "a", tokens, A)
    cache(pool, "a2", tokens, A)  # a device hit of 12
    pool.evict(pool.evictable_size())
    hit_of(pool, "a3", tokens, A)  # a host hit of 12
    cache(pool, "d", seq(61, pages=1))
    stats = pool.namespace_stats()
    assert set(stats) == {namespace_label(A), "default"}
    row = stats[namespace_label(A)]
    assert row["cached_tokens"] == 12  # loaded back by a3, unlocked
    assert (row["device_hit_tokens"], row["host_hit_tokens"], row["storage_hit_tokens"]) == (
        12,
        12,
        0,
    )
    assert row["matched_tokens"] == 24 and row["lookup_tokens"] == 36
    assert stats["default"]["cached_tokens"] == 4
    assert all(B not in label and A not in label for label in stats)  # labels, not digests
    assert len(pool.namespace_stats(top=1)) == 1
    finish(pool)


def test_match_counters_of_many_namespaces_stay_bounded(monkeypatch):
    from memsvc.core import request_prefix

    monkeypatch.setattr(request_prefix, "MAX_NAMESPACE_HITS", 4)
    pool = make_pool()
    cache(pool, "a", seq(64), A)  # A keeps cached tokens: its counters stay
    for i in range(10):
        hit_of(pool, f"t{i}", seq(65), namespace_of(f"tenant-{i}", None))
    hits = pool._prefixes.namespace_hits
    assert len(hits) <= 4 and A in hits
    assert namespace_of("tenant-9", None) in hits
    finish(pool)


def test_counters_follow_evictions_and_the_hierarchys_loads():
    pool = make_pool("hicache")
    tokens = seq(62)
    cache(pool, "a", tokens, A)
    cache(pool, "b", seq(63, pages=2), B)
    assert pool.tree.namespace_tokens() == {A: 12, B: 8}
    assert pool.evict(4) == 12  # the LRU leaf, whole: A's
    assert pool.tree.namespace_tokens() == {B: 8}
    pool.evict(pool.evictable_size())
    assert pool.tree.namespace_tokens() == {}
    hit_of(pool, "a2", tokens, A)  # loaded back from the host tier
    assert pool.tree.namespace_tokens() == {A: 12}
    finish(pool)


# -- a model of three namespaces -------------------------------------------------------

NAMESPACES = [DEFAULT_NAMESPACE, A, B]
PROMPTS = [np.random.default_rng(70 + i).integers(1, 9, size=3 * PAGE + 1) for i in range(3)]


class NamespaceMachine(RuleBasedStateMachine):
    """Random requests, flushes and caps over three namespaces against a model: each
    namespace's cached page-aligned prefixes (the pool is big enough that only flushes
    and the cap evict). The cap is only checked as a bound (which prefixes it keeps is
    the tree's LRU)."""

    kind = "radix"

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(self.kind, num_pages=96)
        self.cached: dict[str, set[tuple[int, ...]]] = {ns: set() for ns in NAMESPACES}
        self.ever_capped = False  # salted namespaces' model is then an upper bound
        self.count = 0

    def expected(self, ns: str, tokens: np.ndarray) -> int:
        best = 0
        for length in range(PAGE, len(tokens) + 1, PAGE):
            if tuple(tokens[:length].tolist()) in self.cached[ns]:
                best = length
        return best

    @rule(ns=st.sampled_from(NAMESPACES), prompt=st.integers(0, 2), cut=st.integers(1, 13))
    def request(self, ns, prompt, cut):
        tokens = PROMPTS[prompt][:cut]
        self.count += 1
        rid = f"r{self.count}"
        self.pool.open_request(rid, ns)
        hit = self.pool.match_prefix(rid, tokens[:-1])
        want = self.expected(ns, tokens[:-1])
        if self.ever_capped and ns:
            assert hit <= want
        else:
            assert hit == want
        assert self.pool.alloc_extend([(rid, len(tokens) - hit)]) is not None
        self.pool.release(rid, tokens)
        cap = self.pool.tree.namespace_cap
        if cap and ns:
            assert self.pool.tree.namespace_tokens().get(ns, 0) <= cap
        aligned = len(tokens) - len(tokens) % PAGE
        for length in range(PAGE, aligned + 1, PAGE):
            self.cached[ns].add(tuple(tokens[:length].tolist()))

    @rule(ns=st.sampled_from(NAMESPACES))
    def flush_one(self, ns):
        self.pool.flush_cache(namespace=ns)
        self.cached[ns] = set()
        assert ns not in self.pool.tree.namespace_tokens()

    @rule()
    def flush_all(self):
        self.pool.flush_cache()
        self.cached = {ns: set() for ns in NAMESPACES}

    @rule(cap=st.sampled_from([0, 4, 8]))
    def set_cap(self, cap):
        self.pool.tree.set_namespace_cap(cap)
        self.ever_capped = self.ever_capped or bool(cap)

    @invariant()
    def sound(self):
        self.pool.check_integrity(idle=True)
        held = self.pool.tree.namespace_tokens()
        for ns in NAMESPACES:
            if ns and self.ever_capped:
                continue  # the cap's LRU decides which of the model's prefixes stay
            longest = max((len(p) for p in self.cached[ns]), default=0)
            assert held.get(ns, 0) >= longest  # (several prefixes may share nodes)
            assert (ns in held) == bool(self.cached[ns])

    def teardown(self):
        self.pool.settle_copies()
        self.pool.check_integrity(idle=True)
        self.pool.close()


class HiNamespaceMachine(NamespaceMachine):
    kind = "hicache"


class SWANamespaceMachine(NamespaceMachine):
    kind = "swa"  # no SWA eviction here: nothing is tombstoned, matches are the model's


_settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestNamespaceModel = NamespaceMachine.TestCase
TestNamespaceModel.settings = _settings
TestHiNamespaceModel = HiNamespaceMachine.TestCase
TestHiNamespaceModel.settings = _settings
TestSWANamespaceModel = SWANamespaceMachine.TestCase
TestSWANamespaceModel.settings = _settings
