"""memsvc with the hierarchical cache: the wire (in process) and a process with all three tiers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.client import MemClient, RetractTarget
from memsvc.core import KVPool
from memsvc.core.hicache import HiCacheConfig
from memsvc.core.storage.file import SUFFIX
from memsvc.handlers import MemService, ServiceConfig
from tests.helpers import small_layout
from tests.procs import REPO, SMALL_POOL
from tests.service.test_handlers import Caller, ids


def make_service(hicache: HiCacheConfig | None) -> MemService:
    layout = small_layout(page_size=4, num_pages=16, max_running_requests=4)
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes, hicache=hicache)
    return MemService(pool, ServiceConfig(retract_decode_steps=4, max_message_bytes=1 << 16))


@pytest.fixture
def service(tmp_path) -> Iterator[MemService]:
    layout = small_layout(page_size=4, num_pages=16)
    service = make_service(
        HiCacheConfig(
            size_bytes=8 * layout.bytes_per_page,
            storage_backend="file",
            storage_dir=str(tmp_path / "store"),
        )
    )
    try:
        yield service
    finally:
        service.pool.close()


def test_flag_off_replies_are_unchanged() -> None:
    service = make_service(None)
    try:
        c = Caller(service)
        assert c.hello()["hicache"] is None
        c.ok("alloc_row", rid="a")
        reply = c.ok("match_prefix", {"token_ids": np.arange(9)}, rid="a")
        assert "host_hit" not in reply and reply["prefix_len"] == 0
        assert c.ok("stats")["hicache"] is None
        c.ok("free_row", rid="a")
        c.ok("check", idle=True)
    finally:
        service.pool.close()


def fill(c: Caller, rid: str, tokens: np.ndarray) -> dict:
    """Admit ``rid`` (match, extend) and return the match reply."""
    c.ok("alloc_row", rid=rid)
    match = c.ok("match_prefix", {"token_ids": tokens[:-1]}, rid=rid)
    c.ok("alloc_extend", {"num_tokens": ids(len(tokens) - match["prefix_len"])}, rids=[rid])
    return match


def test_match_reply_counts_tokens_per_tier(service) -> None:
    c = Caller(service)
    assert c.hello()["hicache"]["write_policy"] == "write_through"
    tokens = np.arange(1, 14)
    assert fill(c, "a", tokens)["prefix_len"] == 0
    c.ok("release", {"token_ids": tokens}, rid="a", is_insert=True)
    c.ok("flush_cache", device_only=True)  # device -> host (the host copies stay)
    match = fill(c, "b", tokens)
    assert (match["prefix_len"], match["device_hit"], match["host_hit"]) == (12, 0, 12)
    assert match["storage_hit"] == 0
    stats = c.ok("stats")["hicache"]
    assert stats["hit_tokens"]["host"] == 12 and stats["load_bytes"] > 0
    c.ok("free_row", rid="b")
    c.ok("check", idle=True)


def test_retract_into_tree_over_the_wire(service) -> None:
    c = Caller(service)
    c.hello()
    a, b = np.arange(100, 124), np.arange(200, 224)  # 6 pages each, 12 of 16 used
    fill(c, "a", np.concatenate([a, [1]]))
    fill(c, "b", np.concatenate([b, [1]]))
    rows = ids(service.pool.request("a").row, service.pool.request("b").row)
    kv_a, kv_b = (service.pool.slots(r).size for r in ("a", "b"))
    tokens_a = np.concatenate([a, [1]])[:kv_a]
    tokens_b = np.concatenate([b, [1]])[:kv_b]
    # a bad length fails alone and changes nothing (one short would be a decode slot
    # reserved ahead, given back: tests/core/test_decode_reservation.py)
    bad = c.call(
        "retract",
        {
            "rows": rows,
            "tree_tokens": tokens_b[:-2],
            "tree_lens": ids(0, kv_b - 2),
        },
        targets=["free", "tree"],
    )
    assert not bad["ok"] and bad["code"] == "invalid_argument", bad
    assert service.pool.is_open("a") and service.pool.is_open("b")
    service.pool.check_integrity()
    reply = c.ok(
        "retract",
        {
            "rows": rows,
            "tree_tokens": tokens_b,
            "tree_lens": ids(0, kv_b),
        },
        targets=["free", "tree"],
    )
    assert reply["retracted"] == ["b"] and reply["to_tree"] == ["b"] and reply["tree_bytes"] > 0
    assert not service.pool.is_open("b")
    c.ok("release", {"token_ids": tokens_a}, rid="a", is_insert=True)
    c.ok("flush_cache", device_only=True)
    match = fill(c, "b2", np.concatenate([b, [1, 2]]))
    assert match["prefix_len"] == 24 and match["device_hit"] == 0  # flushed, then loaded
    assert match["host_hit"] + match["storage_hit"] == 24
    c.ok("free_row", rid="b2")
    # without the hierarchy a tree retract is refused
    plain = make_service(None)
    try:
        p = Caller(plain)
        p.hello()
        fill(p, "a", np.concatenate([a, [1]]))
        fill(p, "b", np.concatenate([b, [1]]))
        rows = ids(plain.pool.request("a").row, plain.pool.request("b").row)
        reply = p.call(
            "retract",
            {
                "rows": rows,
                "tree_tokens": np.concatenate([tokens_a, tokens_b]),
                "tree_lens": ids(kv_a, kv_b),
            },
            targets=["tree", "tree"],
        )
        assert not reply["ok"] and "hierarchical" in reply["message"]
        assert plain.pool.is_open("a") and plain.pool.is_open("b")
        p.ok("free_row", rid="a")
        p.ok("free_row", rid="b")
        p.ok("check", idle=True)
    finally:
        plain.pool.close()
    c.ok("check", idle=True)


def test_lease_expiry_while_a_load_is_in_flight(service) -> None:
    c = Caller(service)
    c.hello(lease_s=5.0)
    tokens = np.arange(1, 14)
    fill(c, "a", tokens)
    c.ok("release", {"token_ids": tokens}, rid="a", is_insert=True)
    c.ok("flush_cache", device_only=True)
    c.ok("alloc_row", rid="b")
    assert c.ok("match_prefix", {"token_ids": tokens[:-1]}, rid="b")["host_hit"] == 12
    assert service.expire_sessions(now=10.0) == [c.session]  # b's locks and load go
    service.pool.settle_copies()
    service.pool.check_integrity(idle=True)


# -- a memsvc process with all three tiers ------------------------------------------------

PAGE_BYTES = 1 * 2 * 4 * 1 * 8 * 4  # SMALL_POOL: 1 layer, K and V, 4 tokens, 1 head x 8, f32


def write_kv(pool, row: int, start: int, tokens: np.ndarray) -> None:
    for pos in range(start, len(tokens)):
        slot = int(pool.req_to_token[row, pos])
        pool.kv[slot // 4, :, :, slot % 4] = float(tokens[pos] * 1000 + pos)


def read_kv(pool, row: int, n: int) -> np.ndarray:
    slots = pool.req_to_token[row, :n].astype(np.int64)
    return pool.kv[slots // 4, 0, 0, slots % 4, 0, 0]


def test_memsvc_process_with_host_and_disk_tiers(memsvc_factory, tmp_path) -> None:
    store = tmp_path / "store"
    flags = [
        "--enable-hierarchical-cache",
        "--hicache-size",
        f"{4 * PAGE_BYTES / 1e9:.12f}",  # a 4-page host tier: the rest goes to disk
        "--hicache-write-policy",
        "write_back",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-dir",
        str(store),
        "--hicache-storage-size",
        f"{64 * PAGE_BYTES / 1e9:.12f}",
        "--metrics-port",
        "0",
    ]
    svc = memsvc_factory(*flags)
    convs = [np.arange(1000 * i, 1000 * i + 17) for i in range(1, 5)]  # 4 pages + 1 each
    with MemClient(svc.address) as mem, mem.attach() as pool:
        for i, tokens in enumerate(convs):
            row = mem.alloc_row(f"r{i}")
            assert mem.match_prefix(f"r{i}", tokens[:-1]) == 0
            assert mem.alloc_extend([(f"r{i}", len(tokens))]).fits
            write_kv(pool, row, 0, tokens)
            mem.release(f"r{i}", tokens)
        mem.flush_cache(device_only=True)  # write_back: device -> host -> (host LRU) disk
        stats = mem.stats()["hicache"]
        assert stats["storage_used_bytes"] > 0 and stats["host_used_bytes"] <= 4 * PAGE_BYTES
        assert page_files(store)
        tiers = {"host": 0, "storage": 0}
        for i, tokens in enumerate(convs):
            row = mem.alloc_row(f"again{i}")
            match = mem.match_prefix_tiers(f"again{i}", tokens[:-1])
            assert match.prefix_len == 16 and match.device_hit == 0
            tiers["host"] += match.host_hit
            tiers["storage"] += match.storage_hit
            assert mem.alloc_extend([(f"again{i}", 1)]).fits  # waits for the load
            expected = tokens[:16] * 1000 + np.arange(16)
            np.testing.assert_array_equal(read_kv(pool, row, 16), expected)
            mem.free_row(f"again{i}")
        assert tiers["host"] > 0 and tiers["storage"] > 0
        # a normal-mode retract victim into the tree, through the client
        keep, victim = np.arange(5000, 5013), np.arange(6000, 6013)
        rows = []
        for rid, tokens in (("keep", keep), ("victim", victim)):
            rows.append(mem.alloc_row(rid))
            mem.match_prefix(rid, tokens[:-1])
            assert mem.alloc_extend([(rid, len(tokens))]).fits
            write_kv(pool, rows[-1], 0, tokens)
        reply = mem.retract(
            rows, [RetractTarget.FREE, RetractTarget.TREE], token_ids=[None, victim]
        )
        assert reply.retracted == ["victim"] and reply.to_tree == ["victim"]
        mem.free_row("keep")
        mem.flush_cache(device_only=True)
        row = mem.alloc_row("victim-again")
        match = mem.match_prefix_tiers("victim-again", np.concatenate([victim, [7]]))
        assert match.prefix_len == 12 and match.device_hit == 0
        assert mem.alloc_extend([("victim-again", 2)]).fits
        np.testing.assert_array_equal(read_kv(pool, row, 12), victim[:12] * 1000 + np.arange(12))
        mem.free_row("victim-again")
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
        for name in (
            "sglang:hicache_host_used_tokens",
            "sglang:hicache_backup_bytes_total",
            "sglang:load_back_bytes_total",
            'kvstack_hicache_hit_tokens_total{tier="storage"}',
            "kvstack_hicache_storage_used_bytes",
            "kvstack_hicache_storage_load_failures_total",
            "kvstack_hicache_storage_write_failures_total",
        ):
            assert name in text, name
        mem.check(idle=True)
    # restart: a clean stop removes memsvc's own subdirectory; the next one starts empty
    (subdir,) = store.iterdir()
    assert subdir.name.startswith(f"normal-{svc.proc.pid}-")
    assert svc.stop(signal.SIGTERM) == 0
    assert list(store.iterdir()) == []
    svc2 = memsvc_factory(*flags, name="memsvc-2")
    with MemClient(svc2.address) as mem:
        assert page_files(store) == []
        mem.alloc_row("late")
        match = mem.match_prefix_tiers("late", convs[0][:-1])
        assert match.prefix_len == 0
        mem.free_row("late")
        mem.check(idle=True)


def page_files(store) -> list:
    return sorted(store.rglob("*" + SUFFIX))


def fill_storage(mem: MemClient, pool, tag: str) -> list[np.ndarray]:
    """Requests whose KV ends up in the storage tier (the host tier is 4 pages)."""
    convs = [np.arange(100 * i, 100 * i + 17) for i in range(1, 7)]
    for i, tokens in enumerate(convs):
        rid = f"{tag}{i}"
        row = mem.alloc_row(rid)
        assert mem.match_prefix(rid, tokens[:-1]) == 0
        assert mem.alloc_extend([(rid, len(tokens))]).fits
        write_kv(pool, row, 0, tokens)
        mem.release(rid, tokens)
    mem.flush_cache(device_only=True)
    assert mem.stats()["hicache"]["storage_used_bytes"] > 0
    return convs


def test_memsvc_on_a_shared_storage_dir_keeps_to_its_own(memsvc_factory, tmp_path) -> None:
    """Issue 26 item 5: two memsvc on one --hicache-storage-dir (the PD nodes, a second
    stack). Before: the second deleted the first one's pages at start, and each one's idle
    check counted the other's files. Each keeps to its own subdirectory now; one killed
    leaves its subdirectory, which the next memsvc there removes, never a live one's."""
    store = tmp_path / "store"
    flags = [
        "--enable-hierarchical-cache", "--hicache-size", f"{4 * PAGE_BYTES / 1e9:.12f}",
        "--hicache-write-policy", "write_back", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(store),
    ]  # fmt: skip
    first = memsvc_factory(*flags, name="memsvc-a")
    second = memsvc_factory(*flags, name="memsvc-b")
    with MemClient(first.address) as mem, mem.attach() as pool:
        convs = fill_storage(mem, pool, "a")
    with MemClient(second.address) as mem, mem.attach() as pool:
        fill_storage(mem, pool, "b")
        mem.check(idle=True)
    subdirs = {int(p.name.split("-")[1]): p for p in store.iterdir()}
    assert set(subdirs) == {first.proc.pid, second.proc.pid}
    assert second.stop(signal.SIGKILL) != 0  # dies with its pages on disk
    second.leaked_segments.clear()  # killed on purpose: the launcher unlinked its segments
    mine = page_files(subdirs[first.proc.pid])
    third = memsvc_factory(*flags, name="memsvc-c")  # removes the dead one's subdirectory
    assert not subdirs[second.proc.pid].exists()
    assert page_files(subdirs[first.proc.pid]) == mine
    with MemClient(first.address) as mem, mem.attach() as pool:
        mem.check(idle=True)  # its files == its index: nothing stray, nothing missing
        storage_hits = 0
        for i, tokens in enumerate(convs[-3:]):  # the newest: the storage cap kept them
            row = mem.alloc_row(f"again{i}")
            match = mem.match_prefix_tiers(f"again{i}", tokens[:-1])
            assert match.prefix_len == 16, match
            storage_hits += match.storage_hit
            assert mem.alloc_extend([(f"again{i}", 1)]).fits
            np.testing.assert_array_equal(
                read_kv(pool, row, 16), tokens[:16] * 1000 + np.arange(16)
            )
            mem.free_row(f"again{i}")
        assert storage_hits > 0
        mem.check(idle=True)
    assert first.stop(signal.SIGTERM) == 0 and third.stop(signal.SIGTERM) == 0
    assert list(store.iterdir()) == []


def test_memsvc_refuses_a_storage_dir_others_can_write(memsvc_factory, tmp_path) -> None:
    """Issue 26 item 4: memsvc started on a 0777 directory, silently."""
    store = tmp_path / "open"
    store.mkdir()
    store.chmod(0o777)
    out = subprocess.run(
        [sys.executable, "-m", "memsvc", *SMALL_POOL, "--enable-hierarchical-cache",
         "--hicache-storage-backend", "file", "--hicache-storage-dir", str(store)],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "writable by others" in out.stderr and str(store) in out.stderr
    assert list(store.iterdir()) == []


def test_pd_roles_name_the_storage_subdirectories(tmp_path) -> None:
    from memsvc.__main__ import build_parser, hicache_config_from_args

    for role, name in (("none", "normal"), ("prefill", "prefill"), ("decode", "decode")):
        args = build_parser().parse_args(
            [*SMALL_POOL, "--enable-hierarchical-cache", "--pd-role", role]
        )
        config = hicache_config_from_args(args)
        assert config.storage_role == name and config.storage_dir is None


def test_memsvc_flags_help_and_bad_combinations(tmp_path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "memsvc", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )

    out = run("--help")
    for flag in (
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "--hicache-size",
        "--hicache-write-policy",
        "--hicache-storage-backend",
        "--hicache-storage-dir",
        "--hicache-storage-size",
    ):
        assert flag in out.stdout, flag
    out = run(*SMALL_POOL, "--enable-hierarchical-cache", "--disable-radix-cache")
    assert out.returncode == 2 and "needs the radix cache" in out.stderr
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    out = run(
        *SMALL_POOL,
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-dir",
        str(blocker),
    )
    assert out.returncode == 2 and "unusable" in out.stderr
    out = run(*SMALL_POOL, "--enable-hierarchical-cache", "--hicache-write-policy", "sometimes")
    assert out.returncode == 2 and "invalid choice" in out.stderr
