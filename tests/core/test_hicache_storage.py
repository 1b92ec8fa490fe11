"""The storage tier under attack (issue 26, items 1-5): pages that vanish or lie, writes that
fail, links planted in the directory, directories that are not ours, and two memsvc on one.

A page read back from storage is verified (a checksum over its bytes and its key) before
it is used; a missing, short, corrupt or unreadable page is a miss for its request
alone: the request's prefix stops at the last good page and the rest is recomputed.
Every test reads the KV a request was handed value by value (``kv_of``) and ends with
the pool's idle check, which also compares the page files with the tree's index.
"""

from __future__ import annotations

import os
import resource
import stat
import threading

import numpy as np
import pytest

from memsvc.core import KVPool
from memsvc.core.backends.base import KVBuffers
from memsvc.core.errors import InvalidArgumentError, MemsvcError
from memsvc.core.hicache import HiCacheConfig, page_hash_chain
from memsvc.core.storage.file import SUFFIX
from tests.core.storage_faults import DAMAGE_KINDS, FullDiskStorage, damage_file
from tests.core.test_hicache import (
    PAGE,
    SlowCopies,
    finish,
    kv_of,
    kv_shape,
    layout,
    make_pool,
    run_request,
    seq,
    two_holders_of_one_load,
)

pytestmark = pytest.mark.timeout(60)  # a FIFO planted as a page must not hang a read


def store_only(pool: KVPool, tokens: np.ndarray) -> list[str]:
    """Put ``tokens``' page-aligned prefix in the storage tier only; returns its page keys."""
    run_request(pool, "writer", tokens)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(pool.hicache.host.num_pages)
    pool.settle_copies()
    aligned = len(tokens) - len(tokens) % PAGE
    keys = page_hash_chain("", tokens[:aligned], PAGE)
    assert set(keys) <= pool.hicache._storage_keys
    assert pool.hicache.tier_tokens()["device"] == 0
    return keys


def page_path(pool: KVPool, key: str) -> str:
    return os.path.join(pool.hicache.storage.directory, key + SUFFIX)


def page_files(pool: KVPool) -> set[str]:
    return {n for n in os.listdir(pool.hicache.storage.directory) if n.endswith(SUFFIX)}


def check_kv(pool: KVPool, rid: str, tokens: np.ndarray, length: int) -> None:
    got = pool.buffers.read_slots(pool.slots(rid, 0, length))
    np.testing.assert_array_equal(got, kv_of(tokens[:length], 0, kv_shape(pool)))


def expect_cut(pool: KVPool, items: list[tuple[str, int]]) -> dict[str, int]:
    """``alloc_extend(items)`` must report the prefixes its loads cut back (and allocate
    nothing), not serve what failed, nor fail the whole batch."""
    try:
        slots = pool.alloc_extend(items)
    except MemsvcError as exc:
        assert exc.code == "prefix_cut", f"{type(exc).__name__}: {exc}"
        return exc.cut
    if slots is not None:
        pool.release(items[0][0], is_insert=False)
    pytest.fail("a page that failed verification was served as KV")


def recompute(pool: KVPool, rid: str, tokens: np.ndarray) -> None:
    """Extend ``rid`` from its (cut) prefix to the end, write that KV, insert."""
    prefix_len = pool.request(rid).kv_len
    check_kv(pool, rid, tokens, prefix_len)
    slots = pool.alloc_extend([(rid, len(tokens) - prefix_len)])
    assert slots is not None
    pool.buffers.write_slots(slots, kv_of(tokens, prefix_len, kv_shape(pool)))
    pool.release(rid, tokens)


# -- items 1-2: a page that vanished or lies is a miss for its request alone --------------


def test_lost_page_file_is_a_miss_for_its_request_alone(tmp_path):
    """Issue 26 item 1: a page file deleted under memsvc. Before: ``CopyFailedError`` at
    the request's alloc_extend, which the scheduler took as the end of everything."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tokens = seq(100, 3)
    keys = store_only(pool, tokens)
    os.unlink(page_path(pool, keys[1]))
    other = seq(7, 1)
    slow = SlowCopies(pool)  # the load is still running when the match returns
    pool.open_request("a")
    pool.open_request("b")
    assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 12
    assert pool.match_prefix_tiers("b", other[:-1]).prefix_len == 0
    slow.gate.set()
    assert expect_cut(pool, [("b", len(other)), ("a", 1)]) == {"a": PAGE}
    assert pool.request("a").kv_len == PAGE  # the good first page stays, verified
    check_kv(pool, "a", tokens, PAGE)
    slots = pool.alloc_extend([("b", len(other))])  # b never noticed
    pool.buffers.write_slots(slots, kv_of(other, 0, kv_shape(pool)))
    pool.release("b", other)
    recompute(pool, "a", tokens)
    assert pool.hicache.stats.storage_load_failures == 1
    pool.settle_copies()
    assert keys[1] + SUFFIX not in page_files(pool)  # the bad page left the tier
    assert run_request(pool, "again", tokens).device_tokens == 12
    finish(pool)


DAMAGE = [*DAMAGE_KINDS, "empty", "directory", "fifo"]


# What can happen to a Mooncake object (a page record) behind memsvc's back.
MOONCAKE_DAMAGE = ("delete", "truncate", "corrupt", "zero", "swap")


def damage_object(pool: KVPool, keys: list[str], kind: str) -> None:
    """Damage the Mooncake object of ``keys[1]`` through the backend's own client."""
    storage = pool.hicache.storage
    store, name = storage._store, storage.prefix + keys[1]
    record = store.get(name)
    assert len(record) == storage.record_bytes
    if kind == "delete":
        assert store.remove(name, True) == 0
        return
    if kind == "truncate":
        record = record[: len(record) // 2]
    elif kind == "corrupt":
        flipped = bytearray(record)
        flipped[len(record) // 3] ^= 0x10
        record = bytes(flipped)
    elif kind == "zero":
        record = bytes(len(record))
    elif kind == "swap":
        record = store.get(storage.prefix + keys[0])
    assert store.upsert(name, record) == 0


def damage(pool: KVPool, keys: list[str], kind: str) -> None:
    """Damage the page file of ``keys[1]`` (``keys[0]``'s file is a valid page)."""
    if pool.hicache.storage.name == "mooncake":
        damage_object(pool, keys, kind)
        return
    path, good = page_path(pool, keys[1]), page_path(pool, keys[0])
    if kind == "empty":
        os.truncate(path, 0)
    elif kind == "directory":
        os.unlink(path)
        os.mkdir(path)
    elif kind == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    else:
        damage_file(path, kind, good, offset=os.path.getsize(path) // 3)


@pytest.mark.parametrize(
    ("backend", "kind"),
    [(b, k) for b in ("file", "nixl") for k in DAMAGE] + [("mooncake", k) for k in MOONCAKE_DAMAGE],
)
def test_damaged_page_is_never_served(tmp_path, kind, backend, request):
    """Issue 26 item 2: a page file that no longer holds its page (bits flipped, zeroed,
    cut short, another page's bytes, a link, not a file). Before: served as KV (corrupt,
    zero, swap, symlink), or ``CopyFailedError`` (the rest; a FIFO hung the copy thread).
    The checks live in the shared layer: NIXL's POSIX plugin moves the same sealed records,
    and Mooncake Store (issue 31) holds them as objects (a live master on loopback)."""
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    if backend == "mooncake":
        request.getfixturevalue("mooncake_config")
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage=backend)
    tokens = seq(110, 3)
    keys = store_only(pool, tokens)
    damage(pool, keys, kind)
    slow = SlowCopies(pool)
    pool.open_request("a")
    assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 12
    slow.gate.set()
    assert expect_cut(pool, [("a", 1)]) == {"a": PAGE}
    recompute(pool, "a", tokens)
    assert pool.hicache.stats.storage_load_failures == 1
    pool.settle_copies()
    pool.check_integrity()
    if kind == "directory":
        os.rmdir(page_path(pool, keys[1]))  # not ours to delete: memsvc leaves it
    elif kind in ("symlink", "fifo"):
        assert not os.path.exists(page_path(pool, keys[1]))  # dropped with the page
    assert run_request(pool, "again", tokens).device_tokens == 12
    finish(pool)


def test_a_backend_that_copies_synchronously_misses_the_same_way(tmp_path):
    """The cuda backend runs hicache copies at once (``KVBuffers.submit``): a load that
    meets a bad page fails inside the match itself. Before: the error left the match,
    and the scheduler took it for a fault it could not repair."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tokens = seq(118, 3)
    keys = store_only(pool, tokens)
    damage(pool, keys, "corrupt")
    buffers = pool.buffers
    buffers.submit = lambda fn, *args: KVBuffers.submit(buffers, fn, *args)
    pool.open_request("a")
    match = pool.match_prefix_tiers("a", tokens[:-1])
    assert match.prefix_len == PAGE and match.storage_tokens == 0  # the verified page only
    recompute(pool, "a", tokens)
    assert pool.hicache.stats.storage_load_failures == 1
    assert run_request(pool, "again", tokens).device_tokens == 12
    finish(pool)


def test_failure_seen_at_another_match_cuts_every_holder(tmp_path):
    """The load fails while two requests hold the prefix; a third request's match sees it
    first. Each holder learns its own cut at its own alloc_extend, and only there."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tokens = seq(120, 3)
    keys = store_only(pool, tokens)
    damage(pool, keys, "corrupt")
    two_holders_of_one_load(pool, tokens)
    pool.open_request("c")
    assert pool.match_prefix_tiers("c", tokens[:-1]).prefix_len == PAGE  # sees the failure
    assert pool.request("a").kv_len == PAGE and pool.request("b").kv_len == PAGE
    pool.check_integrity()
    assert expect_cut(pool, [("a", 1)]) == {"a": PAGE}
    assert expect_cut(pool, [("b", 1), ("c", 1)]) == {"b": PAGE}
    for rid in ("c", "b", "a"):
        recompute(pool, rid, tokens)
    finish(pool)


def test_failed_load_nobody_holds_is_dropped_at_the_next_match(tmp_path):
    """The loading request left before its alloc_extend: the eviction that finds the
    failed load keeps its good pages and drops the rest, never backing it up."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", policy="write_back")
    tokens = seq(121, 4)
    keys = store_only(pool, tokens)
    damage(pool, [keys[2], keys[3]], "zero")
    slow = SlowCopies(pool)
    pool.open_request("a")
    assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 16
    pool.release("a", is_insert=False)
    slow.gate.set()
    pool.settle_copies()
    backups = pool.hicache.stats.backup_bytes
    pool.evict(pool.evictable_size())  # write_back must not copy a failed load's pages
    assert pool.hicache.stats.backup_bytes <= backups + 3 * pool.layout.bytes_per_page
    match = run_request(pool, "b", tokens)
    assert match.prefix_len == 3 * PAGE  # the three good pages, never the bad one
    finish(pool)


# -- failed writes: a failed backup, counted, nothing left behind ----------------------------


def test_disk_full_write_is_a_failed_backup(tmp_path):
    """Issue 26 item 1 (full disk): a page write that fails (EFBIG here: a file size limit,
    as ENOSPC would) leaves no ``.tmp``, is counted, and the tree never claims the page;
    the prefix is recomputed and the idle check (files == index) passes. Before: ``.tmp``
    files left, the node marked on disk, a later ``CopyFailedError``, "N missing"."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tokens = seq(130, 3)
    run_request(pool, "writer", tokens)
    pool.evict(pool.evictable_size())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (pool.layout.bytes_per_page // 2, hard))
    try:
        pool.hicache.evict_host(pool.hicache.host.num_pages)
        pool.settle_copies()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(pool.hicache.storage.directory) == []  # no .tmp, no page
    assert pool.hicache.stats.storage_write_failures == 3
    pool.open_request("a")
    assert pool.match_prefix_tiers("a", tokens[:-1]).prefix_len == 0
    recompute(pool, "a", tokens)
    finish(pool)


def test_a_storage_that_refuses_every_write(tmp_path):
    """A full disk, by a fault-injecting backend: every backup is a counted failure."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file", storage_pages=8)
    pool.hicache.storage = storage = FullDiskStorage(pool.hicache.storage)
    storage.full = True
    seqs = [seq(140 + i, 3) for i in range(3)]
    for i, tokens in enumerate(seqs):
        run_request(pool, f"w{i}", tokens)
        pool.evict(pool.evictable_size())
        pool.hicache.evict_host(pool.hicache.host.num_pages)
    pool.settle_copies()
    assert pool.hicache.stats.storage_write_failures == 9 and storage.failed_writes == 3
    pool.check_integrity()
    pool.check_integrity(idle=True)
    for i, tokens in enumerate(seqs):
        assert run_request(pool, f"r{i}", tokens).prefix_len == 0
    finish(pool)


# -- item 3: no link is ever followed ---------------------------------------------------------


def test_planted_tmp_symlink_is_not_written_through(tmp_path):
    """Issue 26 item 3: page names are predictable from the tokens; a link planted at
    ``<key>.kvpage.tmp`` made memsvc overwrite its target."""
    pool = make_pool(tmp_path, num_pages=8, host_pages=4, storage="file")
    tokens = seq(150, 3)
    keys = page_hash_chain("", tokens[:12], PAGE)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = page_path(pool, keys[0]) + ".tmp"
    os.symlink(victim, planted)
    run_request(pool, "writer", tokens)
    pool.evict(pool.evictable_size())
    pool.hicache.evict_host(pool.hicache.host.num_pages)
    pool.settle_copies()
    assert victim.read_bytes() == b"precious"
    assert os.path.islink(planted)  # not ours: left where it was
    assert pool.hicache.stats.storage_write_failures >= 1
    pool.open_request("a")
    match = pool.match_prefix_tiers("a", tokens[:-1])
    assert match.storage_tokens == 0  # the page it could not write is not claimed
    recompute(pool, "a", tokens)
    pool.settle_copies()
    pool.check_integrity(idle=True)
    os.unlink(planted)
    finish(pool)


# -- items 4-5: a directory of our own ------------------------------------------------------


def file_pool(tmp_path, base, *, role: str = "normal") -> KVPool:
    lay = layout(8)
    config = HiCacheConfig(
        size_bytes=4 * lay.bytes_per_page,
        storage_backend="file",
        storage_dir=None if base is None else str(base),
        storage_size_bytes=16 * lay.bytes_per_page,
        **({"storage_role": role} if role != "normal" else {}),
    )
    return KVPool(lay, hicache=config)


def test_storage_dir_open_to_others_is_refused(tmp_path):
    """Issue 26 item 4: a 0777 directory (anyone could plant or delete pages) was accepted."""
    base = tmp_path / "open"
    base.mkdir()
    base.chmod(0o777)
    with pytest.raises(InvalidArgumentError, match="writable by others"):
        file_pool(tmp_path, base)
    base.chmod(0o775)
    with pytest.raises(InvalidArgumentError, match="writable by others"):
        file_pool(tmp_path, base)


def test_storage_dir_of_another_user_is_refused(tmp_path):
    base = tmp_path / "theirs"
    base.mkdir()
    base.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(base, 12345, 12345)
    else:
        base = "/"  # root's, not ours
    with pytest.raises(InvalidArgumentError, match="not owned by"):
        file_pool(tmp_path, base)


def test_pages_are_private_and_in_a_subdirectory_of_our_own(tmp_path):
    base = tmp_path / "store"
    base.mkdir(mode=0o755)
    (base / ("stale" + SUFFIX)).write_bytes(b"x" * 10)  # someone's: never touched
    (base / ("odd" + SUFFIX)).mkdir()  # made memsvc exit 2 before
    pool = file_pool(tmp_path, base, role="decode")
    storage = pool.hicache.storage
    sub = storage.directory
    assert os.path.dirname(sub) == str(base)
    assert os.path.basename(sub).startswith("decode-")
    assert stat.S_IMODE(os.lstat(sub).st_mode) == 0o700
    tokens = seq(160, 3)
    store_only(pool, tokens)
    modes = {stat.S_IMODE(os.lstat(os.path.join(sub, n)).st_mode) for n in page_files(pool)}
    assert modes == {0o600}
    assert (base / ("stale" + SUFFIX)).read_bytes() == b"x" * 10
    finish(pool)
    assert not os.path.exists(sub)  # a clean close removes it
    assert sorted(os.listdir(base)) == ["odd" + SUFFIX, "stale" + SUFFIX]


def test_default_storage_dir_is_per_user(tmp_path, monkeypatch):
    """Issue 26 item 4: the default was the fixed, shared ``/tmp/kvstack-hicache``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert HiCacheConfig().storage_dir is None
    pool = file_pool(tmp_path, None)
    sub = pool.hicache.storage.directory
    assert sub.startswith(str(tmp_path / "cache" / "kvstack" / "hicache") + os.sep)
    finish(pool)


def test_two_pools_on_one_storage_dir_never_collide(tmp_path):
    """Issue 26 item 5: a second memsvc on the same directory deleted the first one's
    pages at start, and each one's idle check saw the other's files."""
    base = tmp_path / "shared"
    tokens = seq(170, 3)
    first = file_pool(tmp_path, base, role="prefill")
    store_only(first, tokens)
    second = file_pool(tmp_path, base, role="decode")
    assert first.hicache.storage.directory != second.hicache.storage.directory
    store_only(second, seq(171, 3))
    first.check_integrity(idle=True)
    second.check_integrity(idle=True)
    finish(second)  # its close removes its own pages only
    pool = first
    pool.open_request("a")
    assert pool.match_prefix_tiers("a", tokens[:-1]).storage_tokens == 12
    pool.alloc_extend([("a", 1)])
    check_kv(pool, "a", tokens, 12)
    pool.release("a", is_insert=False)
    finish(pool)
    assert os.listdir(base) == []


def test_a_dead_memsvcs_directory_is_reclaimed_a_live_ones_never(tmp_path):
    """A memsvc killed before its clean close leaves its subdirectory; the next one on the
    same base removes it (its lock is free), and never one whose owner still runs."""
    base = tmp_path / "store"
    live = file_pool(tmp_path, base)
    store_only(live, seq(180, 3))
    dead = base / "normal-999999-0123abcd"
    dead.mkdir(mode=0o700)
    (dead / ("ab12" + SUFFIX)).write_bytes(b"x")
    (dead / ("ab12" + SUFFIX + ".tmp")).write_bytes(b"x")
    kept = base / "decode-999998-4567cdef"  # dead too, but holds a file that is not a page
    kept.mkdir(mode=0o700)
    (kept / ("cd34" + SUFFIX)).write_bytes(b"x")
    (kept / "notes.txt").write_text("not ours to delete")
    pool = file_pool(tmp_path, base)
    assert not dead.exists()
    assert os.listdir(kept) == ["notes.txt"]
    assert len(page_files(live)) == 3
    live.check_integrity(idle=True)
    finish(pool)
    finish(live)


def test_concurrent_damage_never_reaches_a_reader(tmp_path):
    """Pages flipped while loads run: what is handed over is right or cut, never wrong."""
    pool = make_pool(tmp_path, num_pages=12, host_pages=3, storage="file", storage_pages=24)
    seqs = [seq(190 + i, 3) for i in range(4)]
    for tokens in seqs:
        store_only(pool, tokens)
    stop = threading.Event()
    rng = np.random.default_rng(5)

    def vandal() -> None:
        while not stop.is_set():
            names = sorted(page_files(pool))
            if names:
                path = os.path.join(pool.hicache.storage.directory, str(rng.choice(names)))
                try:
                    with open(path, "r+b") as f:
                        f.seek(int(rng.integers(0, pool.layout.bytes_per_page)))
                        f.write(b"\xff")
                except OSError:
                    pass
            stop.wait(0.002)

    thread = threading.Thread(target=vandal)
    thread.start()
    try:
        for rnd in range(6):
            for i, tokens in enumerate(seqs):
                rid = f"r{rnd}-{i}"
                pool.open_request(rid)
                match = pool.match_prefix_tiers(rid, tokens[:-1])
                try:
                    slots = pool.alloc_extend([(rid, len(tokens) - match.prefix_len)])
                except MemsvcError as exc:
                    assert exc.code == "prefix_cut", exc
                    recompute(pool, rid, tokens)
                    continue
                check_kv(pool, rid, tokens, match.prefix_len)
                pool.buffers.write_slots(slots, kv_of(tokens, match.prefix_len, kv_shape(pool)))
                pool.release(rid, tokens)
            pool.evict(pool.evictable_size())
            pool.hicache.evict_host(pool.hicache.host.num_pages)
    finally:
        stop.set()
        thread.join()
    finish(pool)
