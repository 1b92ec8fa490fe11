"""The storage tier on Mooncake Store (``--hicache-storage-backend mooncake``, issue 31 item 1).

A real ``mooncake_master`` on loopback (:mod:`tests.mooncake_master`), the store's
client over TCP. The backend goes through the same tests as ``file`` and ``nixl``
(tests/core/test_hicache_storage.py parametrizes its damaged-page test over it);
here: its config (SGLang's extra config, config file and environment variables), a
page written by one client and read by another, damaged and foreign records, a pool
on it, and the master killed while the tier is in use.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.errors import BackendUnavailableError, InvalidArgumentError
from memsvc.core.hicache import HiCacheConfig
from memsvc.core.storage import create_storage
from memsvc.core.storage.base import TRAILER
from memsvc.core.storage.mooncake import MooncakeConfig, parse_extra_config
from tests.core.test_hicache import SlowCopies, finish, layout, make_pool, run_request, seq
from tests.core.test_hicache_storage import expect_cut, recompute, store_only
from tests.mooncake_master import free_port, require_mooncake, start_master

pytestmark = pytest.mark.timeout(120)

PAGE_BYTES = 256


def page(value: int) -> np.ndarray:
    return np.full(PAGE_BYTES // 4, value, dtype=np.float32)


def open_backend(config: dict, page_bytes: int = PAGE_BYTES):
    from memsvc.core.storage.mooncake import MooncakeStorage

    return MooncakeStorage(MooncakeConfig.from_mapping(config, "test"), page_bytes)


# -- config: as SGLang reads it (no master needed) ----------------------------------------


def test_config_extra_config_first_then_config_file_then_environment(tmp_path):
    env = {
        "MOONCAKE_MASTER": "10.0.0.1:50051",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
        "LOCAL_HOSTNAME": "node-a",
    }
    config = MooncakeConfig.load(None, env)
    assert config.master_server_address == "10.0.0.1:50051"
    assert config.global_segment_size == 2 << 30
    assert config.local_hostname == "node-a"  # SGLang's legacy fallback
    assert config.metadata_server == "P2PHANDSHAKE" and config.protocol == "tcp"

    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.2:1", "device_name": "x"}))
    env["SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"] = str(path)
    config = MooncakeConfig.load('{"extra_backend_tag": "m1"}', env)
    assert config.master_server_address == "10.0.0.2:1" and config.device_name == "x"
    assert config.global_segment_size == 4 << 30  # SGLang's default, not the env's
    assert config.extra_backend_tag == "m1"  # the extra config's tag still counts

    extra = {"master_server_address": "127.0.0.1:7", "global_segment_size": 1 << 20}
    config = MooncakeConfig.load(json.dumps(extra), env)
    assert config.master_server_address == "127.0.0.1:7" and config.global_segment_size == 1 << 20
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    assert MooncakeConfig.load(f"@{tmp_path / 'extra.json'}", env) == config


@pytest.mark.parametrize(
    ("extra", "env", "match"),
    [
        (None, {}, "needs a master"),
        ('{"client_server_address": "h:1"}', {}, "standalone"),
        ("{not json", {}, "not JSON"),
        ("[1]", {}, "not a JSON object"),
        ("@/nonexistent/mc.json", {}, "unreadable"),
        (None, {"MOONCAKE_MASTER": "h:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"}, "not bytes"),
    ],
)
def test_config_errors_are_clear(extra, env, match):
    with pytest.raises(InvalidArgumentError, match=match):
        MooncakeConfig.load(extra, env)


def test_extra_config_flag_reaches_the_hicache_config():
    config = HiCacheConfig(storage_backend="mooncake", storage_extra_config='{"a": 1}')
    assert parse_extra_config(config.storage_extra_config) == {"a": 1}
    with pytest.raises(InvalidArgumentError, match="keeps a directory"):
        HiCacheConfig(storage_backend="mooncake", storage_keep=True)


# -- the backend on a live master -----------------------------------------------------------


def test_a_page_written_by_one_client_is_read_by_another(mooncake_config):
    """One store, two clients (two nodes): a page is stored once, under a name that says
    what it is; the record is verified wherever it is read."""
    # the pages live in other's segment (a and b lend none): a's close cannot take them
    other = open_backend({**mooncake_config, "extra_backend_tag": "another-model"})
    a, b = (open_backend({**mooncake_config, "global_segment_size": 0}) for _ in "ab")
    try:
        key, key2 = "ab" * 16, "cd" * 16
        out = np.empty_like(page(0))
        assert b.get(key, out) == "missing"
        a.put(key, page(1))
        assert b.get(key, out) is None
        np.testing.assert_array_equal(out, page(1))
        assert other.get(key, out) == "missing"  # another tag: another name
        b.put(key, page(2))  # stored once: the first node's record stays
        assert a.get(key, out) is None
        np.testing.assert_array_equal(out, page(1))
        assert a.keys() == {key} and b.keys() == {key}  # each lists what it wrote
        assert b.exists([key, key2]) == [True, False]  # but finds what another wrote
        assert other.exists([key]) == [False]
        with pytest.raises(ValueError, match="a page is"):
            a.put(key2, np.zeros(3, np.float32))

        store, name = a._store, a.prefix + key
        record = store.get(name)
        assert len(record) == PAGE_BYTES + TRAILER.size
        flipped = bytearray(record)
        flipped[7] ^= 0x10
        for damaged, why in [
            (bytes(flipped), "checksum mismatch"),
            (bytes(len(record)), "not a sealed page"),
            (record[:100], f"100 bytes, not {len(record)}"),
            (record + b"x", "unreadable"),  # longer than a record
        ]:
            assert store.upsert(name, damaged) == 0
            found = b.get(key, out)
            assert found is not None and found.startswith(why), found
            assert a.exists([key]) == [False]  # removed: nobody can use it
        a.put(key2, page(3))
        assert store.upsert(name, store.get(a.prefix + key2)) == 0  # another key's page
        assert b.get(key, out) == "checksum mismatch"
        a.put(key, page(4))  # stored again after the damaged record went
        assert b.get(key, out) is None
        np.testing.assert_array_equal(out, page(4))

        a.delete(key2)  # a's tree dropped it: a forgets it, the page stays for b
        a.delete(key2)  # a missing key is not an error
        assert a.keys() == {key} and b.exists([key2]) == [True]
        assert b.get(key2, out) is None
        a.close()  # close leaves the pages too: b still reads them
        assert b.exists([key, key2]) == [True, True]
        assert b.get(key2, out) is None
    finally:
        for backend in (a, b, other):
            backend.close()


def test_pool_round_trip_through_mooncake(tmp_path, mooncake_config):
    pool = make_pool(tmp_path, num_pages=8, host_pages=3, storage="mooncake")
    assert pool.hicache.storage.name == "mooncake"
    assert not (tmp_path / "store").exists()  # no directory of its own
    a, b = seq(40, 3), seq(41, 3)
    run_request(pool, "a", a)
    run_request(pool, "b", b)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(3)
    assert run_request(pool, "a2", a).storage_tokens == 12
    assert pool.hicache.stats.storage_load_failures == 0
    finish(pool)


def test_master_killed_while_in_use_is_a_miss_never_wrong_kv(tmp_path, monkeypatch):
    """The master dies under a pool whose pages are in the tier: the load is a miss for
    its request, who recomputes; writes fail as failed backups (OSError, counted); after
    the first failure every call fails at once for retry_after_s."""
    with start_master(tmp_path) as master:
        config = master.config("killed", retry_after_s=60)  # fail fast for the whole test
        path = tmp_path / "mc.json"
        path.write_text(json.dumps(config))
        monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
        pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="mooncake")
        storage = pool.hicache.storage
        tokens = seq(130, 3)
        keys = store_only(pool, tokens)
        assert storage.keys() == set(keys)
        master.kill()
        assert master.proc.poll() is not None

        slow = SlowCopies(pool)  # the load is still running when the match returns
        pool.open_request("a")
        assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 12
        slow.gate.set()
        assert expect_cut(pool, [("a", 1)]) == {"a": 0}  # the first page already fails
        recompute(pool, "a", tokens)
        assert pool.hicache.stats.storage_load_failures == 1

        started = time.monotonic()
        out = np.empty(storage.page_bytes // 4, np.float32)
        assert storage.get(keys[0], out) == "master unreachable"
        with pytest.raises(OSError, match="master unreachable"):
            storage.put(keys[0], out)
        assert storage.keys() == set()
        assert time.monotonic() - started < 2.0  # failing fast, not on RPC timeouts

        other = seq(131, 3)
        run_request(pool, "b", other)  # its backups fail; the request does not notice
        pool.evict(pool.evictable_size())
        pool.hicache.evict_host(pool.hicache.host.num_pages)
        pool.settle_copies()
        assert pool.hicache.stats.storage_write_failures >= 1
        again = run_request(pool, "b2", other)  # its KV from wherever it still is, checked
        assert again.storage_tokens == 0
        finish(pool)


def test_unreachable_master_fails_at_once(tmp_path):
    require_mooncake()
    address = f"127.0.0.1:{free_port()}"
    config = HiCacheConfig(
        storage_backend="mooncake",
        storage_extra_config=json.dumps({"master_server_address": address}),
    )
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="does not answer"):
        create_storage(config, page_bytes=64)
    with pytest.raises(BackendUnavailableError, match="does not answer"):
        KVPool(layout(), hicache=config)
    assert time.monotonic() - started < 10  # not Mooncake's own 90 s of retries


def test_the_master_fixture_leaves_nothing_running(tmp_path):
    with start_master(tmp_path) as master:
        pid = master.proc.pid
        assert master.proc.poll() is None
    assert master.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
