"""The hierarchical cache's tree: where each node's KV lives, and how a tier makes room.

:class:`TieredTree` is the mechanism under :class:`~memsvc.core.hicache.HiRadixCache`
(see that module for the tiers, their invariants and the policies): a node's
KV in the device pool, the host tier and the storage tier; backing a node up
to host, demoting a host copy to storage, each lower tier's own LRU to make
room, dropping what no tier holds any more, the handling of failed loads and
writes, and the integrity check. It never decides when KV moves: matching,
loading back, the write policies and device eviction are ``HiRadixCache``'s,
which is the cache to use (``TieredTree`` alone inherits the device-only
:class:`RadixCache` calls, which know nothing of the tiers).

Each tier's eviction candidates live in an
:class:`~memsvc.core.evict_heap.EvictionHeap` that every change to a node's
tiers, children, locks or access time pushes to, so no eviction walks the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE, PageAllocator
from memsvc.core.backends.base import KVBuffers
from memsvc.core.errors import IntegrityError, InvalidArgumentError
from memsvc.core.evict_heap import EvictionHeap, lru_rank
from memsvc.core.fence import CopyFence
from memsvc.core.hicache_config import HiCacheConfig
from memsvc.core.hicache_cost import LoadCostModel
from memsvc.core.hicache_tiers import HiCacheStats, HostTier, TierCopies
from memsvc.core.radix_cache import RadixCache, TreeNode
from memsvc.core.storage import StorageBackend, create_storage
from memsvc.core.storage.chain import page_hash_chain
from memsvc.core.storage.kept import KeptPages, shared_run
from memsvc.core.tree_events import DEVICE, HOST, STORAGE

_EMPTY = np.empty(0, dtype=SLOT_DTYPE)


@dataclass(slots=True, eq=False)
class HiTreeNode(TreeNode):
    host_pages: np.ndarray | None = None  # host arena page per page of the key
    on_disk: bool = False  # every page of the key is in the storage tier
    hashes: list[str] | None = None  # storage keys, one per page (computed on demand)
    hit_count: int = 0
    load_fence: CopyFence | None = None  # the copy loading ``value`` (None: no load)


def _host_rank(node: TreeNode) -> tuple[bool, int]:
    """The host tier's LRU puts the copies of device nodes last."""
    return bool(node.value.size), node.last_access_time


class TieredTree(RadixCache):
    """A radix tree whose nodes may live in the host and storage tiers too (the module
    docstring says what it does and does not do)."""

    def __init__(
        self,
        allocator: PageAllocator,
        buffers: KVBuffers,
        config: HiCacheConfig,
        *,
        storage: StorageBackend | None = None,
        storage_seed: Callable[[str], str] | None = None,
    ) -> None:
        super().__init__(allocator)
        # A namespace's hash-chain seed (memsvc.core.identity.KVIdentity.storage_seed).
        self.storage_seed = storage_seed or (lambda namespace: namespace)
        self.buffers = buffers
        self.config = config
        self.write_policy = config.write_policy
        page_bytes = buffers.layout.bytes_per_page
        self.page_bytes = page_bytes
        self.host = HostTier(buffers, self._host_num_pages(config, allocator.num_pages))
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
        self.stats = HiCacheStats()
        self.copies = TierCopies(buffers, allocator, self.host, self.stats)
        # Pages a kept storage tier (--hicache-storage-keep) holds that no node holds yet.
        self.kept = self._open_kept()
        self.zero_freed_host = False  # --zero-freed-kv (the pool sets it)
        self.cost = self._cost_model(config, allocator.num_pages)
        # Each tier's eviction candidates (evict_heap.py): device leaves, host copies,
        # storage copies that may go.
        self._free_leaves = EvictionHeap(lru_rank, self._is_device_leaf)
        self._host_heap = EvictionHeap(_host_rank, self._host_evictable)
        self._storage_heap = EvictionHeap(lru_rank, self._storage_evictable)

    def _open_kept(self) -> KeptPages:
        """The kept pages a previous memsvc left, the oldest deleted past the cap."""
        if self.storage is None or not self.config.storage_keep:
            return KeptPages()
        kept = KeptPages(self.storage.keys_oldest_first())
        over = len(kept) - self.storage_capacity_pages
        if over > 0:
            self.copies.delete(self.storage, kept.oldest(over))
        return kept

    def _host_num_pages(self, config: HiCacheConfig, device_pages: int) -> int:
        """The host tier's pages (a subclass whose pages hold more KV sizes it otherwise)."""
        return config.host_pages(device_pages, self.page_bytes)

    def _cost_model(self, config: HiCacheConfig, device_pages: int) -> LoadCostModel:
        """The load-or-recompute model, its copy path timed on the host tier's copies."""
        return LoadCostModel.for_config(config, self.buffers, self.host.arena, device_pages)

    def _new_node(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> TreeNode:
        self._num_nodes_created += 1
        return HiTreeNode(key, value, parent, self._num_nodes_created)

    def settle(self) -> None:
        """Wait for every copy issued so far."""
        self.copies.settle()

    # -- eviction candidates -----------------------------------------------------------

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (
            node.parent is not None  # neither the root nor dropped
            and node.lock_ref == 0
            and bool(node.value.size)
            and not any(c.value.size for c in node.children.values())
        )

    def _is_device_candidate(self, node: TreeNode) -> bool:
        return self._is_device_leaf(node)

    def _touch(self, node: TreeNode) -> None:
        self._free_leaves.push(node)
        self._host_heap.push(node)
        self._storage_heap.push(node)
        if self.namespace_cap and node.namespace:
            self._push_namespace_leaf(node)

    def _check_eviction_heaps(self) -> None:
        self._check_heap(self._free_leaves, self._is_device_leaf, "device leaves")
        self._check_namespace_heaps()
        self._check_heap(self._host_heap, self._host_evictable, "evictable host copies")
        self._check_heap(self._storage_heap, self._storage_evictable, "evictable storage copies")

    # -- node placement --------------------------------------------------------------

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
        self._touch(upper)  # a candidate of the lower tiers too, now that it holds copies
        return upper

    def _hashes(self, node: TreeNode) -> list[str]:
        """The node's storage keys (hash chain from the root), computed once."""
        chain = []
        at = node
        while at is not self.root and at.hashes is None:
            chain.append(at)
            at = at.parent
        # A namespace's chain starts from its own seed: equal tokens in two namespaces
        # never share a storage key.
        prev = self.storage_seed(node.namespace) if at is self.root else at.hashes[-1]
        for n in reversed(chain):
            n.hashes = page_hash_chain(prev, n.key, self.page_size)
            prev = n.hashes[-1]
        return node.hashes

    def _adopt_kept(
        self, path: list[TreeNode], key: np.ndarray, matched: int, seed: str, namespace: str = ""
    ) -> None:
        """Continue a match that ran out of tree through the kept pages
        (:mod:`memsvc.core.storage.kept`): the run of ``key``'s next whole pages whose keys
        are kept becomes a storage-only node under the path's last node (the walk left no
        child there for the next page). ``seed``: the chain's seed at the root. A shared
        tier (mooncake) is asked instead, once: the pages other nodes wrote
        (:func:`~memsvc.core.storage.kept.shared_run`), room made for them here."""
        shared = self.storage is not None and self.storage.shared
        if not len(self.kept) and not shared:
            return
        last = path[-1] if path else self.root
        prev = self._hashes(last)[-1] if path else seed
        if shared:
            cap = self.storage_capacity_pages
            keys = shared_run(self.storage, prev, key[matched:], self.page_size, cap)
            if keys and not self._storage_reserve(len(keys), {id(n) for n in path}):
                return
        else:
            keys = self.kept.run(prev, key[matched:], self.page_size)
        if not keys:
            return
        self.kept.take(keys)
        tokens = key[matched : matched + len(keys) * self.page_size].copy()
        node = self._new_node(tokens, _EMPTY, last)
        node.on_disk, node.hashes = True, keys
        node.last_access_time = self._clock
        node.namespace = last.namespace if path else namespace
        last.children[self._edge_key(node)] = node
        self._storage_keys.update(keys)
        self.events.stored(node, STORAGE)
        self._touch(node)
        path.append(node)

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

    # -- the host tier -------------------------------------------------------------

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
        self.copies.to_host(dev_pages, host_pages)
        node.host_pages = host_pages
        self.events.stored(node, HOST)
        self._touch(node)
        self.stats.backup_bytes += num_pages * self.page_bytes
        self.stats.backup_tokens += len(node.key)
        self.stats.backups += 1
        if self.storage is not None and self.storage.shared and not node.on_disk:
            # SGLang's write-through to storage: other nodes find the pages there now,
            # not once this node's host tier overflows
            self._store_copy(node, protect | {id(node)})
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
        copy of a device node, else drop a host-only leaf. Each candidate is tried once."""
        freed, kept = 0, {}
        while freed < num_pages and (node := self._host_heap.pop()) is not None:
            if id(node) in protect or id(node) in kept:
                kept[id(node)] = node
                continue
            pages = node.host_pages
            if node.on_disk:
                self._free_host(node)
            elif self.storage is not None and self._demote(node, protect):
                pass
            elif node.value.size:
                self._free_host(node)
            elif not node.children:
                self._drop_subtree(node)  # its parent may be a candidate now
            else:
                kept[id(node)] = node  # it could not go: it stays a candidate
                continue
            freed += pages.size
        for node in kept.values():
            self._host_heap.push(node)

    def _free_host(self, node: TreeNode) -> None:
        self.events.removed(node, HOST)
        self.host.free(node.host_pages)
        if self.zero_freed_host and node.namespace:  # --zero-freed-kv: salted KV
            self.copies.zero_host(self.host.arena, node.host_pages)
        node.host_pages = None

    def _demote(self, node: TreeNode, protect: set[int]) -> bool:
        """Write a node's host pages to storage and free them."""
        if not self._store_copy(node, protect | {id(node)}):
            return False
        self._free_host(node)
        return True

    def _store_copy(self, node: TreeNode, protect: set[int]) -> bool:
        """Write a node's host pages to storage (they stay on the host)."""
        num_pages = len(node.key) // self.page_size
        if not self._storage_reserve(num_pages, protect):
            return False
        keys = list(self._hashes(node))
        self.kept.take(keys)  # a kept copy of the same page is rewritten: ours now
        self.copies.to_storage(self.storage, node.host_pages.copy(), keys)
        self._storage_keys.update(keys)
        node.on_disk = True
        self.events.stored(node, STORAGE)
        self._touch(node)
        self.stats.storage_write_bytes += num_pages * self.page_bytes
        return True

    # -- the storage tier ----------------------------------------------------------

    def _storage_evictable(self, node: TreeNode) -> bool:
        if not node.on_disk or node.parent is None:
            return False
        return bool(node.value.size) or node.host_pages is not None or not node.children

    def _storage_reserve(self, num_pages: int, protect: set[int]) -> bool:
        room = self.storage_capacity_pages - len(self._storage_keys) - len(self.kept)
        if num_pages > self.storage_capacity_pages:
            return False
        if room < num_pages and len(self.kept):  # kept pages nobody asked for go first
            gone = self.kept.oldest(num_pages - room)
            self.copies.delete(self.storage, gone)
            room += len(gone)
        if num_pages <= room:
            return True
        kept = {}
        while room < num_pages and (node := self._storage_heap.pop()) is not None:
            if id(node) in protect:
                kept[id(node)] = node
                continue
            room += len(node.key) // self.page_size
            if node.value.size or node.host_pages is not None:
                self._delete_storage(node)
            else:
                self._drop_subtree(node)  # its parent may be a candidate now
        for node in kept.values():
            self._storage_heap.push(node)
        return room >= num_pages

    def drop_kept(self) -> int:
        """Delete every kept page no node holds (a flush: whose KV they are is not known
        without their prefix); returns how many."""
        gone = self.kept.clear()
        if gone:
            self.copies.delete(self.storage, gone)
        return len(gone)

    def _delete_storage(self, node: TreeNode) -> None:
        keys = list(self._hashes(node))
        self._storage_keys.difference_update(keys)
        node.on_disk = False
        self.events.removed(node, STORAGE)
        self.copies.delete(self.storage, keys)

    # -- failed loads and writes -----------------------------------------------------

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
        failed = self.copies.take_failed_writes()
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
                    self.events.removed(n, DEVICE)
                    slots, n.value = n.value, _EMPTY
                    self._num_evictable_tokens -= len(n.key)
                    if n.namespace:
                        self._count_namespace(n.namespace, -len(n.key))
                    self.allocator.free(slots)
                n.load_fence = None
            self._drop_subtree(node)

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove an unlocked, off-device node and everything below it from all tiers."""
        parent = node.parent
        del parent.children[self._edge_key(node)]
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
        self._touch(parent)  # a leaf in some tier now, maybe

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
        if not self.kept.keys().isdisjoint(self._storage_keys):
            raise IntegrityError("storage tier: a kept page is also a node's")
        if len(self._storage_keys) + len(self.kept) > self.storage_capacity_pages:
            raise IntegrityError("storage tier over its cap")
        self._check_eviction_heaps()

    def check_idle(self) -> None:
        """After every copy settled: the backend holds exactly the keys the tree indexes."""
        if self.storage is None:
            return
        self.settle()
        if self.reap_failed_writes():
            self.settle()  # the deletes it issued
        indexed = self._storage_keys | self.kept.keys()
        if self.storage.shared:  # other nodes' pages are no strays; ours must be there
            listed = sorted(indexed)
            found = self.storage.exists(listed)
            stored = {k for k, held in zip(listed, found, strict=True) if held}
        else:
            stored = self.storage.keys()
        if stored != indexed:
            raise IntegrityError(
                f"storage tier: {len(stored - indexed)} stray pages, "
                f"{len(indexed - stored)} missing"
            )

    def close(self) -> None:
        self.settle()
        if self.storage is not None:
            self.storage.close()
