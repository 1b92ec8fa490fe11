"""Hierarchical prefix cache: the radix tree over three tiers (SGLang's HiCache).

A node's KV lives in the device pool (``value``: its slots), in the host tier
(``host_pages``: pages of a host arena), in the storage tier (``on_disk``: one
page block per page, keyed by the hash of the token ids from the root to the
end of that page), or in several at once::

    root ─ A[dev+host] ─ B[dev] ─ C[host]      a path: device nodes first,
                        └ D[host] ─ E[disk]      then host / disk-only nodes

Invariants (:meth:`HiRadixCache.check`): every node holds its KV in at least
one tier; the device-resident nodes are closed under parent (the parent of a
device node is on the device too), so a match is a run of device nodes
followed by host / storage nodes; a locked node is on the device; every
device, host and storage page belongs to exactly one node; the evictable and
protected counters count device tokens only (as :class:`RadixCache`'s).

Write policies (``--hicache-write-policy``, SGLang's names): ``write_through``
copies a node to host when it is inserted; ``write_through_selective`` once it
has been hit :data:`WRITE_THROUGH_SELECTIVE_THRESHOLD` times; ``write_back``
when it is evicted from the device. Evicting a device leaf keeps the node if
it has a host or storage copy, else drops it (and the host / storage-only
subtree below it, which nothing could reach any more). The host tier has its
own LRU: evicting a host copy demotes it to storage when a storage tier is
configured, else drops the node (leaves only). Storage has its own LRU too.

A match that runs into host / storage nodes loads them into fresh device pages
(evicting device LRU leaves, never the matched path) before it returns, all or
nothing as SGLang's ``load_back``: an off-device part under
:data:`LOAD_BACK_THRESHOLD` tokens, or one the device cannot take whole, is not
loaded, and the match stops at the device prefix. Every copy (device <-> host,
host -> storage, storage -> device, storage deletes) runs as one job on the
buffers' copy thread (:meth:`KVBuffers.submit`), in issue order, so:

- a load is fenced: the node keeps the job's fence (``load_fence``) and the
  pool makes the request's next ``alloc_extend`` wait for it; pages it writes
  that are freed meanwhile stay pending behind it (``allocator.copy_issued``);
- a host page or storage key freed while a job still reads it is reused only by
  a later job, which runs after it: a load never races an eviction, nor a
  write-back a free, and no op ever waits except on the loads it hands out.

No lock outlives an op on the host or storage tier (ops are atomic and the
copies ordered), so session expiry has nothing to release there beyond the
request locks the pool releases.

Storage faults: every page read back from storage is verified (its checksum
covers its bytes and its key, :mod:`memsvc.core.storage.base`). A load that
meets a missing, short, corrupt or unreadable page copies the good pages before
it and fails its fence (:class:`StoredPageError`); whoever finds the failure
(the request's fence at ``alloc_extend``, a later match, an eviction) splits the
node after its good pages (:meth:`HiRadixCache.split_failed`) and drops the rest
from every tier: a miss for the requests that matched it, who recompute from
there. A page write that fails is a failed backup: counted, nothing left behind,
and the node it was for gives up its storage copy at the next match, flush or
check (:meth:`HiRadixCache.reap_failed_writes`), before anyone reads it.

Restart: the host tier is process memory and is lost with memsvc. The storage
tier lives in a subdirectory of this memsvc's own, made fresh when the cache is
created and removed when it is closed (:mod:`memsvc.core.storage.tierdir`): its
index was the tree, which dies with the process, so nothing a previous memsvc
(or another stack on the same directory) left is ever read.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memsvc.core.allocator import OWNER_TREE, SLOT_DTYPE, PageAllocator
from memsvc.core.backends.base import KVBuffers, page_runs
from memsvc.core.errors import IntegrityError, InvalidArgumentError, StoredPageError
from memsvc.core.fence import DONE, CopyFence, FailedFence
from memsvc.core.hicache_config import HiCacheConfig, WritePolicy  # HiCacheConfig: re-exported
from memsvc.core.prefix_cache import CacheHit
from memsvc.core.radix_cache import MatchResult, RadixCache, TreeNode
from memsvc.core.storage import StorageBackend, create_storage

log = logging.getLogger("memsvc")

WRITE_THROUGH_SELECTIVE_THRESHOLD = 2  # SGLang's: hits before a node is backed up
# SGLang's HiRadixCache.load_back_threshold (hard-coded there, no flag): an off-device
# part of a match shorter than this many tokens is recomputed, not loaded.
LOAD_BACK_THRESHOLD = 10
_EMPTY = np.empty(0, dtype=SLOT_DTYPE)


@dataclass(slots=True, eq=False)
class HiTreeNode(TreeNode):
    host_pages: np.ndarray | None = None  # host arena page per page of the key
    on_disk: bool = False  # every page of the key is in the storage tier
    hashes: list[str] | None = None  # storage keys, one per page (computed on demand)
    hit_count: int = 0
    load_fence: CopyFence | None = None  # the copy loading ``value`` (None: no load)


@dataclass
class HiCacheStats:
    hit_tokens: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "storage": 0}
    )
    load_bytes: int = 0
    load_tokens: int = 0
    load_seconds: float = 0.0
    backup_bytes: int = 0
    backup_tokens: int = 0
    backup_seconds: float = 0.0
    storage_write_bytes: int = 0
    storage_read_bytes: int = 0
    storage_seconds: float = 0.0
    dropped_tokens: int = 0
    storage_load_failures: int = 0  # loads that met a page failing verification
    storage_write_failures: int = 0  # pages of storage backups that a failed write undid
    backups: int = 0  # copy jobs, for the duration summaries
    loads: int = 0


class HostTier:
    """A host arena of whole pool pages with a free list (no entries: the tree indexes it)."""

    def __init__(self, buffers: KVBuffers, num_pages: int) -> None:
        self.num_pages = num_pages
        self.page_bytes = buffers.layout.bytes_per_page
        self.arena = buffers.alloc_host(num_pages)
        self.arena.view(np.uint8).reshape(-1)[::4096] = 0  # fault every OS page in now
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)  # stack: page 0 first
        self._num_free = num_pages
        self.in_use = np.zeros(num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._num_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._num_free:
            return None
        top = self._num_free
        pages = self._free[top - n : top][::-1].copy()
        self._num_free -= n
        self.in_use[pages] = True
        return pages

    def free(self, pages: np.ndarray) -> None:
        if not self.in_use[pages].all():
            raise IntegrityError("host tier: freeing a host page that is not in use")
        self.in_use[pages] = False
        top = self._num_free
        self._free[top : top + pages.size] = pages[::-1]
        self._num_free += pages.size

    def free_list(self) -> np.ndarray:
        return self._free[: self._num_free].copy()


def page_hash_chain(prev: str, tokens: np.ndarray, page_size: int) -> list[str]:
    """Storage keys of consecutive pages: each hashes the previous key and its page's tokens."""
    out = []
    for start in range(0, len(tokens), page_size):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(prev.encode())
        digest.update(np.ascontiguousarray(tokens[start : start + page_size]).tobytes())
        prev = digest.hexdigest()
        out.append(prev)
    return out


class HiRadixCache(RadixCache):
    """:class:`RadixCache` whose nodes may live in the host and storage tiers too."""

    def __init__(
        self,
        allocator: PageAllocator,
        buffers: KVBuffers,
        config: HiCacheConfig,
        *,
        storage: StorageBackend | None = None,
    ) -> None:
        super().__init__(allocator)
        self.buffers = buffers
        self.config = config
        self.write_policy = config.write_policy
        page_bytes = buffers.layout.bytes_per_page
        self.page_bytes = page_bytes
        self.host = HostTier(buffers, config.host_pages(allocator.num_pages, page_bytes))
        try:
            if storage is None and config.storage_backend is not None:
                storage = create_storage(config, page_bytes)
        except OSError as exc:
            raise InvalidArgumentError(
                f"hicache storage directory {config.storage_dir or 'default'!r} is unusable: {exc}"
            ) from exc
        self.storage = storage
        self.storage_capacity_pages = (
            config.storage_pages(self.host.num_pages, page_bytes) if storage else 0
        )
        self._storage_keys: set[str] = set()
        self._failed_writes: deque[list[str]] = deque()  # appended by the copy thread
        self.stats = HiCacheStats()
        self._last_fence: CopyFence = DONE

    def _new_node(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> TreeNode:
        self._num_nodes_created += 1
        return HiTreeNode(key, value, parent, self._num_nodes_created)

    # -- sizes -------------------------------------------------------------------

    def host_used_tokens(self) -> int:
        return self.host.used_pages * self.page_size

    def host_capacity_tokens(self) -> int:
        return self.host.num_pages * self.page_size

    def storage_used_bytes(self) -> int:
        return len(self._storage_keys) * self.page_bytes

    def storage_capacity_bytes(self) -> int:
        return self.storage_capacity_pages * self.page_bytes

    def tier_tokens(self) -> dict[str, int]:
        """Tokens by where their KV is: on the device, host-only, storage-only."""
        out = {"device": 0, "host_only": 0, "storage_only": 0}
        for node in self.iter_nodes():
            if node.value.size:
                out["device"] += len(node.key)
            elif node.host_pages is not None:
                out["host_only"] += len(node.key)
            else:
                out["storage_only"] += len(node.key)
        return out

    # -- copies ------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Any], *args: Any, pool_pages: bool) -> CopyFence:
        try:
            fence = self.buffers.submit(fn, *args)
        except StoredPageError as exc:  # a backend that copies at once (cuda): as if later
            fence = FailedFence(exc)
        self._last_fence = fence
        if pool_pages and not fence.done():
            # Pages freed from now on wait for it. (A copy that ran synchronously must not
            # replace the fence of an asynchronous offload still running.)
            self.allocator.copy_issued(fence)
        return fence

    def settle(self) -> None:
        """Wait for every copy issued so far."""
        self._last_fence.wait()

    def _job_to_host(self, dev_pages: np.ndarray, host_pages: np.ndarray) -> None:
        started = time.perf_counter()
        arena = self.host.arena
        for index, first, length in page_runs(host_pages):
            self.buffers.gather_pages(
                dev_pages[index : index + length], arena[first : first + length]
            )
        self.stats.backup_seconds += time.perf_counter() - started

    def _job_from_host(self, host_pages: np.ndarray, dev_pages: np.ndarray) -> None:
        started = time.perf_counter()
        arena = self.host.arena
        for index, first, length in page_runs(host_pages):
            self.buffers.scatter_pages(
                arena[first : first + length], dev_pages[index : index + length]
            )
        self.stats.load_seconds += time.perf_counter() - started

    def _job_host_to_storage(self, host_pages: np.ndarray, keys: list[str]) -> None:
        """Write a node's pages; one that fails fails the node's storage copy (queued for
        :meth:`reap_failed_writes`), and the pages after it are not tried."""
        started = time.perf_counter()
        for page, key in zip(host_pages.tolist(), keys, strict=True):
            try:
                self.storage.put(key, self.host.arena[page])
            except OSError as exc:
                self.stats.storage_write_failures += len(keys)  # the node's whole copy fails
                log.warning("hicache storage: writing page %s failed: %s", key, exc)
                self._failed_writes.append(keys)
                break
        self.stats.storage_seconds += time.perf_counter() - started

    def _job_from_storage(self, keys: list[str], dev_pages: np.ndarray) -> None:
        """Load verified pages; at the first that fails, copy the good ones before it and
        raise :class:`StoredPageError` naming them."""
        started = time.perf_counter()
        staging = self.buffers.alloc_host(len(keys))
        num_good, why = 0, None
        for i, key in enumerate(keys):
            why = self.storage.get(key, staging[i])
            if why is not None:
                break
            num_good += 1
        if num_good:
            self.buffers.scatter_pages(staging[:num_good], dev_pages[:num_good])
        self.stats.load_seconds += time.perf_counter() - started
        if why is not None:
            self.stats.storage_load_failures += 1
            log.warning("hicache storage: page %s failed verification: %s", keys[num_good], why)
            raise StoredPageError(
                f"storage page {keys[num_good]} is unusable: {why}", frozenset(keys[:num_good])
            )

    def _job_storage_delete(self, keys: list[str]) -> None:
        for key in keys:
            self.storage.delete(key)

    # -- match and insert ----------------------------------------------------------

    def match_prefix(self, token_ids: object) -> MatchResult:
        """The device part of the match only (no loading)."""
        key = self._as_key(token_ids)
        path, _ = self._walk(key)
        device = [n for n in path if n.value.size]
        slots = np.concatenate([n.value for n in device]) if device else _EMPTY.copy()
        return MatchResult(slots, device[-1] if device else self.root)

    def match_and_load(self, token_ids: object) -> CacheHit:
        """Longest prefix in any tier; its host / storage part loaded into fresh device
        pages, whole or not at all (:meth:`_load_back`).

        The caller locks ``last_node`` before anything else can evict; the
        pages are readable once ``fence`` is done.
        """
        key = self._as_key(token_ids)
        self.reap_failed_writes()
        path, _ = self._walk(key)
        num_device = 0
        while num_device < len(path) and path[num_device].value.size:
            num_device += 1
        device_tokens = sum(len(n.key) for n in path[:num_device])
        self._count_hits(path[:num_device], protect={id(n) for n in path})
        last_device = path[num_device - 1] if num_device else self.root
        loaded = self._load_back(last_device, path[num_device:])
        host_tokens = sum(len(n.key) for n in loaded if n.host_pages is not None)
        storage_tokens = sum(len(n.key) for n in loaded) - host_tokens
        matched = path[:num_device] + loaded
        hits = self.stats.hit_tokens
        hits["device"] += device_tokens
        hits["host"] += host_tokens
        hits["storage"] += storage_tokens
        loads = []
        for n in matched:
            fence = n.load_fence
            if fence is not None:
                if fence.done() and fence.error() is None:
                    n.load_fence = None
                else:
                    loads.append((n, fence))
        slots = np.concatenate([n.value for n in matched]) if matched else _EMPTY.copy()
        return CacheHit(
            slots,
            matched[-1] if matched else self.root,
            device_tokens,
            host_tokens,
            storage_tokens,
            loads,
        )

    def _load_back(self, last_device: TreeNode, tail: list[TreeNode]) -> list[TreeNode]:
        """Load the off-device ``tail`` of a match (below ``last_device``); returns it, or
        ``[]`` when nothing was loaded.

        SGLang's HiRadixCache.load_back: all or nothing. Under
        :data:`LOAD_BACK_THRESHOLD` tokens it is not worth a copy; otherwise device
        LRU leaves off the matched path are evicted for it, and if the device still
        cannot take all of it, none of it is loaded (the match stops at the device
        prefix and the request recomputes the rest). Storage nodes count with host
        ones: SGLang's storage pages reach the device through this same host load.
        """
        tail_len = sum(len(n.key) for n in tail)
        if tail_len < LOAD_BACK_THRESHOLD:
            return []
        num_pages = tail_len // self.page_size
        self.lock(last_device)  # the matched device path is never evicted for the load
        try:
            shortfall = num_pages - self.allocator.num_free_pages
            if shortfall > 0:
                self._evict_device(shortfall * self.page_size, protect=set(map(id, tail)))
            if num_pages > self.allocator.num_free_pages:
                return []
            for node in tail:
                self._load(node)
        finally:
            self.unlock(last_device)
        return tail

    def _count_hits(self, nodes: Iterable[TreeNode], protect: set[int]) -> None:
        selective = self.write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE
        for node in nodes:
            node.hit_count += 1
            if (
                selective
                and node.host_pages is None
                and node.hit_count >= WRITE_THROUGH_SELECTIVE_THRESHOLD
            ):
                self._backup(node, protect)

    def _load(self, node: TreeNode) -> None:
        """Give an off-device node fresh device pages and issue the copy filling them."""
        num_pages = len(node.key) // self.page_size
        pages = self.allocator.alloc_pages(num_pages, owner=OWNER_TREE)
        if node.host_pages is not None:
            fence = self._submit(
                self._job_from_host, node.host_pages.copy(), pages, pool_pages=True
            )
        else:
            keys = list(self._hashes(node))
            fence = self._submit(self._job_from_storage, keys, pages, pool_pages=True)
            self.stats.storage_read_bytes += num_pages * self.page_bytes
        self.stats.load_bytes += num_pages * self.page_bytes
        self.stats.load_tokens += len(node.key)
        self.stats.loads += 1
        node.value = self.allocator.pages_to_slots(pages)
        node.load_fence = fence
        self._num_evictable_tokens += len(node.key)  # off-device nodes are never locked

    def _insert(self, key: np.ndarray, slots: np.ndarray) -> tuple[int, TreeNode, list[np.ndarray]]:
        """Insert; off-device nodes on the path take the caller's slots (its KV is the same)."""
        path, matched = self._walk(key)
        num_device = 0
        while num_device < len(path) and path[num_device].value.size:
            num_device += 1
        device_len = sum(len(n.key) for n in path[:num_device])
        at = device_len
        for node in path[num_device:]:
            node.value = slots[at : at + len(node.key)].copy()
            node.load_fence = None
            self._num_evictable_tokens += len(node.key)
            at += len(node.key)
        node = path[-1] if path else self.root
        values = [n.value for n in path]
        new = list(path[num_device:])
        if matched < len(key):
            leaf = self._new_node(key[matched:].copy(), slots[matched:].copy(), node)
            leaf.last_access_time = self._clock
            node.children[self._page_key(leaf.key)] = leaf
            self._num_evictable_tokens += len(leaf.key)
            values.append(leaf.value)
            node = leaf
            new.append(leaf)
        if self.write_policy == WritePolicy.WRITE_THROUGH:
            # After the whole path is in place: making host room must not drop part of it.
            protect = {id(n) for n in path} | {id(node)}
            for n in new:
                if n.host_pages is None:
                    self._backup(n, protect)
        return device_len, node, values

    def check_can_back_up(self) -> None:
        """Every device node can be backed up to the host tier."""

    def backup_bytes(self) -> int:
        return self.stats.backup_bytes

    def backup_prefix(self, token_ids: object) -> int:
        """Give every device node on ``token_ids``' cached path a host copy; returns bytes."""
        path, _ = self._walk(self._as_key(token_ids))
        before = self.stats.backup_bytes
        protect = set(map(id, path))
        for node in path:
            if node.value.size and node.host_pages is None:
                self._backup(node, protect)
        return self.stats.backup_bytes - before

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        upper = super()._split(node, split_len)
        num_pages = split_len // self.page_size
        if node.host_pages is not None:
            upper.host_pages = node.host_pages[:num_pages]
            node.host_pages = node.host_pages[num_pages:]
        if node.hashes is not None:
            upper.hashes = node.hashes[:num_pages]
            node.hashes = node.hashes[num_pages:]
        upper.on_disk = node.on_disk
        upper.hit_count = node.hit_count
        upper.load_fence = node.load_fence
        return upper

    def _hashes(self, node: TreeNode) -> list[str]:
        """The node's storage keys (hash chain from the root), computed once."""
        chain = []
        at = node
        while at is not self.root and at.hashes is None:
            chain.append(at)
            at = at.parent
        prev = "" if at is self.root else at.hashes[-1]
        for n in reversed(chain):
            n.hashes = page_hash_chain(prev, n.key, self.page_size)
            prev = n.hashes[-1]
        return node.hashes

    # -- the host tier -------------------------------------------------------------

    def _load_state(self, node: TreeNode) -> str:
        """``"ok"`` (no load, or it succeeded), ``"pending"`` or ``"failed"``; never waits."""
        fence = node.load_fence
        if fence is None:
            return "ok"
        if not fence.done():
            return "pending"
        if fence.error() is None:
            node.load_fence = None
            return "ok"
        return "failed"

    def _backup(self, node: TreeNode, protect: set[int]) -> bool:
        """Copy a device node to the host tier (making room there); False if it cannot."""
        if self._load_state(node) != "ok":
            # Loaded from a copy it still has (host or storage): a backup can wait until
            # the load is known good; one that failed must never be copied anywhere.
            return False
        num_pages = len(node.key) // self.page_size
        host_pages = self._host_alloc(num_pages, protect | {id(node)})
        if host_pages is None:
            return False
        dev_pages = node.value[:: self.page_size] // self.page_size
        self._submit(self._job_to_host, dev_pages, host_pages, pool_pages=True)
        node.host_pages = host_pages
        self.stats.backup_bytes += num_pages * self.page_bytes
        self.stats.backup_tokens += len(node.key)
        self.stats.backups += 1
        return True

    def _host_alloc(self, num_pages: int, protect: set[int]) -> np.ndarray | None:
        if num_pages > self.host.num_pages:
            return None
        if num_pages > self.host.free_pages:
            self._evict_host(num_pages - self.host.free_pages, protect)
        return self.host.alloc(num_pages)

    def _host_evictable(self, node: TreeNode) -> bool:
        if node.host_pages is None or node.parent is None:
            return False
        if node.value.size or node.on_disk or self.storage is not None:
            return True
        return not node.children  # dropping it must orphan nothing

    def evict_host(self, num_pages: int) -> int:
        """Free ``num_pages`` host pages (LRU); returns the pages freed."""
        before = self.host.free_pages
        self._evict_host(num_pages, set())
        return self.host.free_pages - before

    def _evict_host(self, num_pages: int, protect: set[int]) -> None:
        """Host LRU, copies of device nodes last: demote to storage (if any), else free the
        copy of a device node, else drop a host-only leaf."""
        heap = [
            (bool(n.value.size), n.last_access_time, n.node_id, n)
            for n in self.iter_nodes()
            if id(n) not in protect and self._host_evictable(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            *_, node = heapq.heappop(heap)
            if node.parent is None or not self._host_evictable(node):
                continue  # dropped meanwhile
            pages = node.host_pages
            if node.on_disk:
                self._free_host(node)
            elif self.storage is not None and self._demote(node, protect):
                pass
            elif node.value.size:
                self._free_host(node)
            elif not node.children:
                parent = node.parent
                self._drop_subtree(node)
                if id(parent) not in protect and self._host_evictable(parent):
                    heapq.heappush(
                        heap,
                        (bool(parent.value.size), parent.last_access_time, parent.node_id, parent),
                    )
            else:
                continue
            freed += pages.size

    def _free_host(self, node: TreeNode) -> None:
        self.host.free(node.host_pages)
        node.host_pages = None

    def _demote(self, node: TreeNode, protect: set[int]) -> bool:
        """Write a node's host pages to storage and free them."""
        num_pages = len(node.key) // self.page_size
        if not self._storage_reserve(num_pages, protect | {id(node)}):
            return False
        keys = list(self._hashes(node))
        self._submit(self._job_host_to_storage, node.host_pages.copy(), keys, pool_pages=False)
        self._storage_keys.update(keys)
        node.on_disk = True
        self.stats.storage_write_bytes += num_pages * self.page_bytes
        self._free_host(node)
        return True

    # -- the storage tier ----------------------------------------------------------

    def _storage_evictable(self, node: TreeNode) -> bool:
        if not node.on_disk or node.parent is None:
            return False
        return bool(node.value.size) or node.host_pages is not None or not node.children

    def _storage_reserve(self, num_pages: int, protect: set[int]) -> bool:
        room = self.storage_capacity_pages - len(self._storage_keys)
        if num_pages > self.storage_capacity_pages:
            return False
        if num_pages <= room:
            return True
        heap = [
            (n.last_access_time, n.node_id, n)
            for n in self.iter_nodes()
            if id(n) not in protect and self._storage_evictable(n)
        ]
        heapq.heapify(heap)
        while room < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not self._storage_evictable(node):
                continue
            room += len(node.key) // self.page_size
            if node.value.size or node.host_pages is not None:
                self._delete_storage(node)
            else:
                parent = node.parent
                self._drop_subtree(node)
                if id(parent) not in protect and self._storage_evictable(parent):
                    heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        return room >= num_pages

    def _delete_storage(self, node: TreeNode) -> None:
        keys = list(self._hashes(node))
        self._storage_keys.difference_update(keys)
        node.on_disk = False
        self._submit(self._job_storage_delete, keys, pool_pages=False)

    # -- device eviction -------------------------------------------------------------

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (
            node is not self.root
            and node.lock_ref == 0
            and bool(node.value.size)
            and not any(c.value.size for c in node.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise InvalidArgumentError(f"cannot evict {num_tokens} tokens")
        return self._evict_device(num_tokens, set()) if num_tokens else 0

    def _evict_device(self, num_tokens: int, protect: set[int]) -> int:
        """Free device leaves, LRU first; a leaf keeps its host / storage copy if it has one."""
        heap = [
            (n.last_access_time, n.node_id, n) for n in self.iter_nodes() if self._is_device_leaf(n)
        ]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if self._load_state(node) == "failed":
                self.split_failed(node)  # its good pages stay, in a node of their own
            parent = node.parent
            evicted += len(node.key)
            self._evict_device_node(node, protect)
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        return evicted

    def _evict_device_node(self, node: TreeNode, protect: set[int]) -> None:
        state = self._load_state(node)
        if state == "failed":  # the copy it was loaded from is suspect too: drop it
            if node.host_pages is not None:
                self._free_host(node)
            if node.on_disk:
                self._delete_storage(node)
        elif (
            state == "ok"
            and node.host_pages is None
            and self.write_policy == WritePolicy.WRITE_BACK
        ):
            self._backup(node, protect)
        slots = node.value
        node.value = _EMPTY
        node.load_fence = None
        self._num_evictable_tokens -= len(node.key)
        self.allocator.free(slots)  # pending behind any copy still reading or writing them
        if node.host_pages is None and not node.on_disk:
            self._drop_subtree(node)

    def flush(self, *, device_only: bool = False) -> int:
        """SGLang's flush_cache: every unlocked device node evicted and (unless
        ``device_only``) every copy off the device (host and storage) dropped; locked
        paths stay on the device, copies freed. Returns the device tokens evicted."""
        if device_only:
            return self.evict(self.evictable_size())
        self.reap_failed_writes()
        evicted = self.evict(self.evictable_size())
        # Device nodes are closed under parent: the off-device subtrees hang from the
        # root or from a device node.
        tops = [
            n
            for n in self.iter_nodes()
            if not n.value.size and (n.parent is self.root or n.parent.value.size)
        ]
        for node in tops:
            self._drop_subtree(node)
        for node in self.iter_nodes():  # what is left is on the device: drop its copies
            if node.host_pages is not None:
                self._free_host(node)
            if node.on_disk:
                self._delete_storage(node)
        return evicted

    def split_failed(self, node: TreeNode) -> bool:
        """Cut a node whose load failed after the pages that load verified and copied:
        the new upper node keeps them, its load done; ``node`` keeps the rest. Returns
        whether ``node`` still failed (False: all its pages were good)."""
        loaded = getattr(node.load_fence.error(), "loaded", frozenset())
        hashes = self._hashes(node) if loaded else []
        num_good = 0
        while num_good < len(hashes) and hashes[num_good] in loaded:
            num_good += 1
        if num_good == len(hashes) and hashes:
            node.load_fence = None
            return False
        if num_good:
            self._split(node, num_good * self.page_size).load_fence = None
        return True

    def wait_load(self, node: TreeNode, fence: CopyFence) -> bool:
        fence.wait()
        if node.load_fence is not fence:
            return False  # seen to by whoever found it first
        if fence.error() is None:
            node.load_fence = None
            return False
        return node.parent is not None

    def failed_loads_above(self, nodes: Iterable[TreeNode]) -> list[TreeNode]:
        """The nodes from ``nodes`` up to the root whose load failed, each cut after the
        pages its load verified (:meth:`split_failed`): the parts to drop."""
        bad: dict[int, TreeNode] = {}
        for node in nodes:
            at = node  # and its ancestors: a split hands its load to both halves
            while at is not None and at is not self.root:
                failed = id(at) not in bad and self._load_state(at) == "failed"
                if failed and self.split_failed(at):
                    bad[id(at)] = at
                at = at.parent
        return list(bad.values())

    def reap_failed_writes(self) -> int:
        """Nodes whose storage write failed give up their storage copy; one that was
        only there is dropped, with what hangs below it. Returns the keys written in vain.

        A load of such a page, issued after the failed write, finds it missing and
        fails on its own (a miss); nothing stored is ever read unverified.
        """
        failed: set[str] = set()
        while self._failed_writes:
            failed.update(self._failed_writes.popleft())
        if not failed:
            return 0
        hit = [n for n in self.iter_nodes() if n.on_disk and not failed.isdisjoint(self._hashes(n))]
        for node in hit:
            if node.parent is None:
                continue  # dropped with an ancestor
            if node.value.size or node.host_pages is not None:
                self._delete_storage(node)
            else:
                self._drop_subtree(node)
        return len(failed)

    def discard_failed(self, nodes: Iterable[TreeNode]) -> None:
        """Drop nodes whose load failed, and everything below them, from every tier.

        The caller has released every request holding them (none ran a forward
        on them: a request's ``alloc_extend`` waits for its loads first).
        """
        for node in nodes:
            if node.parent is None:
                continue  # already dropped with an ancestor
            stack = [node]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                if n.lock_ref:
                    raise IntegrityError(f"discarding node {n.node_id}, which is locked")
                if n.value.size:
                    slots, n.value = n.value, _EMPTY
                    self._num_evictable_tokens -= len(n.key)
                    self.allocator.free(slots)
                n.load_fence = None
            self._drop_subtree(node)

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove an unlocked, off-device node and everything below it from all tiers."""
        del node.parent.children[self._page_key(node.key)]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.value.size:  # only the caller's node may still be counted: it is not
                raise IntegrityError(f"dropping node {n.node_id}, which is on the device")
            if n.host_pages is not None:
                self._free_host(n)
            if n.on_disk:
                self._delete_storage(n)
            self.stats.dropped_tokens += len(n.key)
            n.parent = None
            n.children = {}

    # -- integrity -----------------------------------------------------------------

    def check(self) -> None:
        """:meth:`RadixCache.check` over the tiers: device nodes closed under parent,
        locks only on the device, every node's KV in some tier, and each tier's pages
        (host arena, storage keys) held by exactly one node and accounted."""
        self._check_root()
        root, ps = self.root, self.page_size
        num_tokens = {True: 0, False: 0}
        host_pages, disk_keys = [], []
        for node, where in self._checked_nodes():
            key_len, parent = len(node.key), node.parent
            if len(node.value) not in (0, key_len):
                raise IntegrityError(f"{where}: key/value lengths {key_len}/{len(node.value)}")
            on_device = bool(node.value.size)
            if on_device and parent is not root and not parent.value.size:
                raise IntegrityError(f"{where}: on the device under an off-device parent")
            if node.lock_ref and not on_device:
                raise IntegrityError(f"{where}: locked but not on the device")
            if not on_device and node.host_pages is None and not node.on_disk:
                raise IntegrityError(f"{where}: its KV is in no tier")
            if node.host_pages is not None:
                if node.host_pages.size != key_len // ps:
                    raise IntegrityError(f"{where}: {node.host_pages.size} host pages")
                host_pages.append(node.host_pages)
            if node.hashes is not None and len(node.hashes) != key_len // ps:
                raise IntegrityError(f"{where}: {len(node.hashes)} storage keys")
            if node.on_disk:
                disk_keys.extend(self._hashes(node))
            if on_device:
                self._count_device_node(node, where, num_tokens)
        self._check_counters(num_tokens)
        held = np.concatenate(host_pages) if host_pages else np.empty(0, np.int64)
        if np.unique(held).size != held.size:
            raise IntegrityError("host tier: a host page is in two nodes")
        if held.size != self.host.used_pages or (held.size and not self.host.in_use[held].all()):
            raise IntegrityError(
                f"host tier: nodes hold {held.size} pages, {self.host.used_pages} in use"
            )
        free = self.host.free_list()
        if np.unique(free).size != free.size or self.host.in_use[free].any():
            raise IntegrityError("host tier: free list disagrees with pages in use")
        if len(disk_keys) != len(set(disk_keys)) or set(disk_keys) != self._storage_keys:
            raise IntegrityError(
                f"storage tier: nodes hold {len(disk_keys)} keys, index {len(self._storage_keys)}"
            )
        if len(self._storage_keys) > self.storage_capacity_pages:
            raise IntegrityError("storage tier over its cap")

    def check_idle(self) -> None:
        """After every copy settled: the backend holds exactly the keys the tree indexes."""
        if self.storage is None:
            return
        self.settle()
        if self.reap_failed_writes():
            self.settle()  # the deletes it issued
        stored = self.storage.keys()
        if stored != self._storage_keys:
            raise IntegrityError(
                f"storage tier: {len(stored - self._storage_keys)} stray pages, "
                f"{len(self._storage_keys - stored)} missing"
            )

    def close(self) -> None:
        self.settle()
        if self.storage is not None:
            self.storage.close()

    def stats_dict(self) -> dict[str, Any]:
        s = self.stats
        tiers = self.tier_tokens()
        return {
            "write_policy": self.write_policy,
            "host_capacity_bytes": self.host.num_pages * self.page_bytes,
            "host_used_bytes": self.host.used_pages * self.page_bytes,
            "host_capacity_tokens": self.host_capacity_tokens(),
            "host_used_tokens": self.host_used_tokens(),
            "storage_backend": self.storage.name if self.storage else None,
            "storage_capacity_bytes": self.storage_capacity_bytes(),
            "storage_used_bytes": self.storage_used_bytes(),
            "device_tokens": tiers["device"],
            "host_only_tokens": tiers["host_only"],
            "storage_only_tokens": tiers["storage_only"],
            "hit_tokens": dict(s.hit_tokens),
            "load_bytes": s.load_bytes,
            "load_tokens": s.load_tokens,
            "load_seconds": s.load_seconds,
            "backup_bytes": s.backup_bytes,
            "backup_tokens": s.backup_tokens,
            "backup_seconds": s.backup_seconds,
            "storage_write_bytes": s.storage_write_bytes,
            "storage_read_bytes": s.storage_read_bytes,
            "storage_seconds": s.storage_seconds,
            "dropped_tokens": s.dropped_tokens,
            "storage_load_failures": s.storage_load_failures,
            "storage_write_failures": s.storage_write_failures,
        }
