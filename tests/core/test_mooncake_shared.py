"""Two nodes sharing the storage tier on one Mooncake master (issue 31, item 1).

Two in-process pools stand for two nodes: a prefix node A computed and backed up is
a storage hit on node B (its match continues the hash chain through the store), with
A's bytes; another namespace or model on B finds nothing; the master killed under
them: B's match recomputes, nothing wrong is served.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.hicache import HiCacheConfig
from memsvc.core.identity import KVIdentity
from tests.core.test_hicache import (
    SlowCopies,
    kv_of,
    kv_shape,
    layout,
    run_request,
    seq,
)
from tests.core.test_hicache_storage import expect_cut, recompute
from tests.mooncake_master import start_master

pytestmark = pytest.mark.timeout(120)

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64


def node(model_digest: str = DIGEST_A, host_pages: int = 8) -> KVPool:
    """A node's pool on the mooncake config the environment names."""
    lay = layout(8)
    config = HiCacheConfig(
        size_bytes=host_pages * lay.bytes_per_page,
        write_policy="write_through",
        storage_backend="mooncake",
        storage_size_bytes=16 * lay.bytes_per_page,
    )
    seed = KVIdentity.of(lay, model_digest).storage_seed
    return KVPool(lay, hicache=config, storage_seed=seed)


def test_a_prefix_node_a_computed_is_a_storage_hit_on_node_b(mooncake_config):
    a, b = node(), node()
    try:
        tokens = seq(200, 3)
        run_request(a, "a", tokens)  # write_through: host backup, and the shared tier
        a.settle_copies()
        assert a.hicache.stats.storage_write_bytes == 3 * a.layout.bytes_per_page

        b.open_request("b")
        match = b.match_prefix_tiers("b", tokens[:-1])
        assert match.storage_tokens == 12 and match.prefix_len == 12
        assert b.alloc_extend([("b", 1)]) is not None  # waits for the verified load
        got = b.buffers.read_slots(b.slots("b", 0, 12))
        np.testing.assert_array_equal(got, kv_of(tokens[:12], 0, kv_shape(b)))  # A's bytes
        b.release("b", tokens[:13])
        assert b.hicache.stats.storage_load_failures == 0
        assert b.hicache.stats.hit_tokens["storage"] == 12

        # B does not store the page again: A's record stays, B's put is create-only
        b.evict(b.evictable_size())
        b.hicache.evict_host(b.hicache.host.num_pages)
        # a longer prompt on B: its own pages after A's, found by A in turn
        longer = np.concatenate([tokens[:12], seq(201, 2, tail=1)])
        assert run_request(b, "b2", longer).storage_tokens == 12
        b.settle_copies()
        a.evict(a.evictable_size())
        a.hicache.evict_host(a.hicache.host.num_pages)
        assert run_request(a, "a2", longer).prefix_len == 20  # 12 its own, 8 B's
        for pool in (a, b):
            pool.settle_copies()
            pool.check_integrity(idle=True)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("other", ["namespace", "model"])
def test_another_namespace_or_model_finds_nothing(mooncake_config, other):
    a = node()
    b = node(DIGEST_B if other == "model" else DIGEST_A)
    try:
        tokens = seq(210, 3)
        run_request(a, "a", tokens)
        a.settle_copies()
        namespace = "5" * 32 if other == "namespace" else ""
        b.open_request("b", namespace)
        match = b.match_prefix_tiers("b", tokens[:-1])
        assert match.prefix_len == 0 and match.storage_tokens == 0
        b.release("b", is_insert=False)
        # the control: a node on A's identity and namespace hits
        same = node()
        try:
            same.open_request("s")
            assert same.match_prefix_tiers("s", tokens[:-1]).storage_tokens == 12
            same.release("s", is_insert=False)
            # checked before any node leaves: a node's segment leaves with it
            for pool in (a, b, same):
                pool.settle_copies()
                pool.check_integrity(idle=True)
        finally:
            same.close()
    finally:
        a.close()
        b.close()


def test_master_killed_while_shared_b_recomputes(tmp_path, monkeypatch):
    """The master dies after A wrote a prefix and B found it: B's load fails and is cut,
    B recomputes; B's next match asks a dead store and finds nothing; A keeps serving
    from its own tiers. Nothing unverified is ever served."""
    with start_master(tmp_path) as master:
        config = master.config("shared-killed", retry_after_s=60)
        path = tmp_path / "mc.json"
        path.write_text(json.dumps(config))
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
        a, b = node(), node()
        try:
            tokens, other = seq(220, 3), seq(221, 3)
            run_request(a, "a", tokens)
            run_request(a, "a-other", other)
            a.settle_copies()

            slow = SlowCopies(b)  # B's load is still running when the master dies
            b.open_request("b")
            assert b.match_prefix_tiers("b", tokens[:-1]).storage_tokens == 12
            master.kill()
            slow.gate.set()
            assert expect_cut(b, [("b", 1)]) == {"b": 0}
            recompute(b, "b", tokens)
            assert b.hicache.stats.storage_load_failures == 1

            b.open_request("b2")  # the store is gone: a miss at once, recomputed
            assert b.match_prefix_tiers("b2", other[:-1]).prefix_len == 0
            recompute(b, "b2", other)
            assert run_request(a, "a2", other).device_tokens == 12  # A serves its own
            for pool in (a, b):  # their backups failed: given up, nothing indexed
                pool.settle_copies()
                pool.hicache.reap_failed_writes()
                pool.settle_copies()
                pool.hicache.flush()
                pool.check_integrity(idle=True)
        finally:
            a.close()
            b.close()


def test_memsvc_refuses_a_shared_tier_without_a_model_digest():
    """Without a model digest two checkpoints of one layout would share keys: another
    model's pages would verify (the checksum covers key and bytes, not whose KV)."""
    from tests.test_model_digest import memsvc_config

    shared = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    with pytest.raises(ValueError, match=r"mooncake \(a shared tier\) needs --model-digest"):
        memsvc_config(shared)
    config = memsvc_config([*shared, "--model-digest", DIGEST_A])
    assert config.identity.model_digest == DIGEST_A
