"""A kept storage tier (``--hicache-storage-keep``) across memsvc restarts (issue 30, item 2).

A restart is a pool closed and a new one opened on the same storage directory. A
kept page is served only when its key is the one the new memsvc asks for: same
model digest, dtype, KV layout, page size, namespace and token prefix (the hash
chain's seed, :mod:`memsvc.core.identity`), and its checksum holds. Every test
reads the KV it was handed (``run_request`` compares it value by value) and ends
with the pool's idle check, which compares the page files with the tree's index
and the kept index.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.errors import InvalidArgumentError, MemsvcError
from memsvc.core.hicache import HiCacheConfig, page_hash_chain
from memsvc.core.identity import KVIdentity, layout_string
from memsvc.core.layout import PoolLayout
from memsvc.core.storage.file import SUFFIX
from tests.core.test_hicache import (
    PAGE,
    SlowCopies,
    finish,
    kv_of,
    kv_shape,
    run_request,
    seq,
)

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64


def keep_layout(*, page_size: int = PAGE, dtype: str = "float32", heads: int = 1) -> PoolLayout:
    return PoolLayout(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=4,
        page_size=page_size,
        num_pages=8,
        dtype=dtype,
        max_running_requests=8,
        max_context_len=128,
    )


def keep_pool(
    tmp_path,
    digest: str | None = DIGEST_A,
    *,
    storage: str = "file",
    storage_pages: int = 16,
    **layout_kw,
) -> KVPool:
    lay = keep_layout(**layout_kw)
    config = HiCacheConfig(
        size_bytes=8 * lay.bytes_per_page,
        storage_backend=storage,
        storage_dir=str(tmp_path / "store"),
        storage_size_bytes=storage_pages * lay.bytes_per_page,
        storage_keep=True,
    )
    identity = KVIdentity.of(lay, digest)
    return KVPool(lay, hicache=config, storage_seed=identity.storage_seed)


def to_storage(pool: KVPool, tokens: np.ndarray) -> list[str]:
    """Run ``tokens`` and push its KV down to the storage tier alone; its page keys."""
    run_request(pool, "writer", tokens)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(pool.hicache.host.num_pages)
    pool.settle_copies()
    ps = pool.page_size
    aligned = len(tokens) - len(tokens) % ps
    keys = page_hash_chain(pool.hicache.storage_seed(""), tokens[:aligned], ps)
    assert set(keys) <= pool.hicache._storage_keys
    return keys


def kept_dir(tmp_path) -> str:
    return str(tmp_path / "store" / "kept-normal")


def page_names(tmp_path) -> set[str]:
    return {n for n in os.listdir(kept_dir(tmp_path)) if n.endswith(SUFFIX)}


def no_storage_served(pool: KVPool) -> None:
    stats = pool.hicache.stats
    assert stats.hit_tokens["storage"] == 0 and stats.storage_read_bytes == 0


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_same_identity_after_restart_hits_storage_with_the_same_bytes(tmp_path, backend):
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    tokens = seq(1, 5)
    pool = keep_pool(tmp_path, storage=backend)
    keys = to_storage(pool, tokens)
    finish(pool)
    assert page_names(tmp_path) == {k + SUFFIX for k in keys}  # kept at close
    pool = keep_pool(tmp_path, storage=backend)
    assert len(pool.hicache.kept) == 5
    match = run_request(pool, "reader", tokens)  # compares every value it was handed
    assert (match.prefix_len, match.storage_tokens) == (20, 20)
    assert pool.hicache.stats.hit_tokens["storage"] == 20
    assert len(pool.hicache.kept) == 0  # adopted by the tree
    finish(pool)
    # A prompt sharing only the first page (under the load threshold: recomputed, and
    # the tree takes its KV), then the whole prompt: device page 0, storage pages 1-4.
    pool = keep_pool(tmp_path, storage=backend)
    other = np.concatenate([tokens[:PAGE], seq(2, 2)])
    match = run_request(pool, "first-page", other)
    assert (match.prefix_len, match.storage_tokens) == (0, 0)
    match = run_request(pool, "again", tokens)
    assert (match.prefix_len, match.device_tokens, match.storage_tokens) == (20, 4, 16)
    finish(pool)


@pytest.mark.parametrize(
    ("what", "kw"),
    [
        ("another checkpoint", {"digest": DIGEST_B}),
        ("no model digest", {"digest": None}),
        ("another dtype", {"dtype": "float64"}),
        ("another page size", {"page_size": 2 * PAGE}),
        ("another KV layout", {"heads": 2}),
    ],
)
def test_another_identity_after_restart_gets_nothing(tmp_path, what, kw):
    tokens = seq(3, 4)
    pool = keep_pool(tmp_path)
    to_storage(pool, tokens)
    finish(pool)
    before = page_names(tmp_path)
    config_kw = dict(kw)
    digest = config_kw.pop("digest", DIGEST_A)
    lay = keep_layout(**config_kw)
    identity = KVIdentity.of(lay, digest)
    pool = KVPool(
        lay,
        hicache=HiCacheConfig(
            size_bytes=8 * lay.bytes_per_page,
            storage_backend="file",
            storage_dir=str(tmp_path / "store"),
            storage_size_bytes=64 * lay.bytes_per_page,
            storage_keep=True,
        ),
        storage_seed=identity.storage_seed,
    )
    assert len(pool.hicache.kept) == len(before), what  # there, and never looked up
    pool.open_request("r")
    match = pool.match_prefix_tiers("r", tokens[:-1])
    assert (match.prefix_len, match.storage_tokens) == (0, 0), what
    no_storage_served(pool)
    pool.release("r", is_insert=False)
    finish(pool)
    assert page_names(tmp_path) == before  # not ours to read, not deleted either


def test_seed_names_every_part_of_the_identity():
    lay = keep_layout()
    base = KVIdentity.of(lay, DIGEST_A)
    seeds = {
        base.storage_seed(""),
        base.storage_seed("0" * 32),
        base.storage_seed("1" * 32),
        KVIdentity.of(lay, DIGEST_B).storage_seed(""),
        KVIdentity.of(lay, None).storage_seed(""),
        KVIdentity.of(keep_layout(dtype="float16"), DIGEST_A).storage_seed(""),
        KVIdentity.of(keep_layout(page_size=8), DIGEST_A).storage_seed(""),
        KVIdentity.of(keep_layout(heads=2), DIGEST_A).storage_seed(""),
    }
    assert len(seeds) == 8 and all(len(s) == 32 for s in seeds)
    assert base.storage_seed("") == KVIdentity.of(lay, DIGEST_A).storage_seed("")
    hybrid = PoolLayout(**{**lay.__dict__, "layer_types": ("sliding_attention", "full_attention"),
                           "sliding_window": 8, "swa_num_pages": 4})  # fmt: skip
    assert layout_string(hybrid) != layout_string(lay)
    with pytest.raises(InvalidArgumentError, match="namespace"):
        base.storage_seed("tenant-a")  # a salt is never a namespace
    with pytest.raises(InvalidArgumentError, match="sha256"):
        KVIdentity.of(lay, "not-a-digest")
    with pytest.raises(InvalidArgumentError, match="--model-digest"):
        KVIdentity.of(lay, None).require_model("--hicache-storage-keep")


def test_a_kept_page_that_lies_is_never_served(tmp_path):
    """A kept page file whose bytes were changed, or another key's page renamed over it,
    fails its checksum (which covers the key): the match stops before it."""
    tokens = seq(4, 3)
    pool = keep_pool(tmp_path)
    keys = to_storage(pool, tokens)
    finish(pool)
    d = kept_dir(tmp_path)
    other = os.path.join(d, keys[0] + SUFFIX)
    os.replace(other, os.path.join(d, keys[1] + SUFFIX))  # page 0's record under page 1's key
    pool = keep_pool(tmp_path)
    assert len(pool.hicache.kept) == 2  # keys[0] gone, keys[1] lies, keys[2] fine
    pool.open_request("r")
    match = pool.match_prefix_tiers("r", tokens[:-1])
    assert match.prefix_len == 0  # the chain starts at keys[0]: missing
    pool.release("r", is_insert=False)
    finish(pool)
    # Put a good page 0 back: the chain now meets the lying page 1 and is cut there.
    pool = keep_pool(tmp_path)
    to_storage(pool, tokens[: PAGE + 1])
    finish(pool)
    pool = keep_pool(tmp_path)
    slow = SlowCopies(pool)  # the load is still in flight when the match returns
    pool.open_request("r")
    match = pool.match_prefix_tiers("r", tokens[:-1])
    assert match.storage_tokens == 12  # matched: the load verifies each page
    slow.gate.set()
    with pytest.raises(MemsvcError) as err:
        pool.alloc_extend([("r", 1)])
    assert err.value.code == "prefix_cut" and err.value.cut == {"r": PAGE}
    pool.release("r", is_insert=False)
    assert run_request(pool, "again", tokens).prefix_len == PAGE  # the good page only
    finish(pool)


def test_a_kept_tier_is_refused_to_a_second_memsvc_and_trimmed_to_its_cap(tmp_path):
    pool = keep_pool(tmp_path)
    with pytest.raises(InvalidArgumentError, match="another memsvc keeps"):
        keep_pool(tmp_path)
    keys = [to_storage(pool, seq(10 + i, 2)) for i in range(3)]
    finish(pool)
    assert len(page_names(tmp_path)) == 6
    for age, run in enumerate(keys):  # written in this order, a second apart
        for key in run:
            os.utime(os.path.join(kept_dir(tmp_path), key + SUFFIX), (1e9 + age, 1e9 + age))
    (tmp_path / "store" / "kept-normal" / ("ab" + SUFFIX + ".tmp")).write_bytes(b"half")
    pool = keep_pool(tmp_path, storage_pages=4)  # the two oldest pages go
    pool.settle_copies()
    assert pool.hicache.kept.keys() == set(keys[1] + keys[2])
    assert page_names(tmp_path) == {k + SUFFIX for k in keys[1] + keys[2]}
    assert not [n for n in os.listdir(kept_dir(tmp_path)) if n.endswith(".tmp")]
    finish(pool)


def test_kept_pages_make_room_first_and_go_with_a_flush(tmp_path):
    pool = keep_pool(tmp_path, storage_pages=4)
    old = to_storage(pool, seq(20, 2))
    newer = to_storage(pool, seq(21, 2))
    finish(pool)
    for key in old:
        os.utime(os.path.join(kept_dir(tmp_path), key + SUFFIX), (1e9, 1e9))
    pool = keep_pool(tmp_path, storage_pages=4)
    mine = to_storage(pool, seq(22, 2))  # the cap is full of kept pages: the oldest two go
    assert pool.hicache.kept.keys() == set(newer)
    pool.settle_copies()
    assert page_names(tmp_path) == {k + SUFFIX for k in newer + mine}
    pool.flush_cache()
    pool.settle_copies()
    assert len(pool.hicache.kept) == 0 and page_names(tmp_path) == set()
    finish(pool)


def test_keep_needs_a_storage_backend():
    with pytest.raises(InvalidArgumentError, match="--hicache-storage-backend"):
        HiCacheConfig(storage_keep=True)


def test_a_kept_page_is_served_to_its_own_namespace_alone(tmp_path):
    """Pages stored by a salted request come back after a restart to that namespace, and
    to no other (nor to the default namespace): the seed names the namespace."""
    tenant_a, tenant_b = "a" * 32, "b" * 32
    tokens = seq(30, 4)
    pool = keep_pool(tmp_path)
    pool.open_request("w", tenant_a)
    slots = pool.alloc_extend([("w", len(tokens))])
    pool.buffers.write_slots(slots, kv_of(tokens, 0, kv_shape(pool)))
    pool.release("w", tokens)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(pool.hicache.host.num_pages)
    finish(pool)
    assert len(page_names(tmp_path)) == 4
    pool = keep_pool(tmp_path)
    for rid, namespace in (("b", tenant_b), ("default", "")):
        pool.open_request(rid, namespace)
        match = pool.match_prefix_tiers(rid, tokens[:-1])
        assert (match.prefix_len, match.storage_tokens) == (0, 0), rid
        pool.release(rid, is_insert=False)
    no_storage_served(pool)
    pool.open_request("a", tenant_a)
    match = pool.match_prefix_tiers("a", tokens[:-1])
    assert (match.prefix_len, match.storage_tokens) == (16, 16)
    assert pool.wait_loaded("a") is None
    np.testing.assert_array_equal(
        pool.buffers.read_slots(pool.slots("a", 0, 16)),
        kv_of(tokens[:16], 0, kv_shape(pool)),
    )
    pool.release("a", is_insert=False)
    finish(pool)
