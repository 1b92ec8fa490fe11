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
:data:`LOAD_BACK_THRESHOLD` tokens, one the cost model finds dearer to copy than
to recompute (:mod:`memsvc.core.hicache_cost`), or one the device cannot take
whole, is not loaded, and the match stops at the device prefix. Every copy (device <-> host,
host -> storage, storage -> device, storage deletes) runs as one job on the
buffers' copy thread (:meth:`KVBuffers.submit`), in issue order, so:

- a load is fenced: the node keeps the job's fence (``load_fence``) and the
  pool makes the request's next ``alloc_extend`` wait for it; pages freed
  meanwhile stay pending behind it (``allocator.copy_issued``); a backup holds
  back only the pages it reads, if they are freed before it ends
  (``allocator.copy_reads``), so no allocation waits on an unrelated backup;
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
(or another stack on the same directory) left is ever read. With
``--hicache-storage-keep`` the directory is kept, and a match that runs out of
tree continues its hash chain (seeded by the model, dtype, layout, page size and
namespace: :mod:`memsvc.core.identity`) through the kept page names, adopting
the run it finds as a storage-only node (:meth:`TieredTree._adopt_kept`,
:mod:`memsvc.core.storage.kept`); its pages are verified when loaded, as any.

Modules: this one is :class:`HiRadixCache`, the policy (match and load back,
the write policies, device eviction); :mod:`memsvc.core.hicache_tree` the
mechanism it builds on (where each node's KV lives, each lower tier's LRU,
failed loads and writes, the integrity check); :mod:`memsvc.core.hicache_tiers`
the host arena, storage keys and the copy jobs (storage reads verified there);
:mod:`memsvc.core.hicache_config` the settings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from memsvc.core.allocator import OWNER_TREE, SLOT_DTYPE
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.evict_heap import EvictionHeap
from memsvc.core.hicache_config import HiCacheConfig, WritePolicy
from memsvc.core.hicache_tiers import HiCacheStats, HostTier
from memsvc.core.hicache_tree import HiTreeNode, TieredTree
from memsvc.core.prefix_cache import CacheHit
from memsvc.core.radix_cache import MatchResult, TreeNode, check_namespace
from memsvc.core.storage.chain import page_hash_chain
from memsvc.core.tree_events import DEVICE
from memsvc.namespace import DEFAULT_NAMESPACE

# Re-exported: the hierarchy's parts, under the name its users know.
__all__ = [
    "LOAD_BACK_THRESHOLD",
    "WRITE_THROUGH_SELECTIVE_THRESHOLD",
    "HiCacheConfig",
    "HiCacheStats",
    "HiRadixCache",
    "HiTreeNode",
    "HostTier",
    "page_hash_chain",
]

WRITE_THROUGH_SELECTIVE_THRESHOLD = 2  # SGLang's: hits before a node is backed up
# SGLang's HiRadixCache.load_back_threshold (hard-coded there, no flag): an off-device
# part of a match shorter than this many tokens is recomputed, not loaded.
LOAD_BACK_THRESHOLD = 10
_EMPTY = np.empty(0, dtype=SLOT_DTYPE)


class HiRadixCache(TieredTree):
    """:class:`RadixCache` whose nodes may live in the host and storage tiers too."""

    # -- match and load back ---------------------------------------------------------

    def match_prefix(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> MatchResult:
        """The device part of the match only (no loading)."""
        key = self._as_key(token_ids)
        path, _ = self._walk(key, check_namespace(namespace))
        device = [n for n in path if n.value.size]
        slots = np.concatenate([n.value for n in device]) if device else _EMPTY.copy()
        return MatchResult(slots, device[-1] if device else self.root)

    def match_and_load(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> CacheHit:
        """Longest prefix in any tier; its host / storage part loaded into fresh device
        pages, whole or not at all (:meth:`_load_back`).

        The caller locks ``last_node`` before anything else can evict; the
        pages are readable once ``fence`` is done.
        """
        key = self._as_key(token_ids)
        check_namespace(namespace)
        self.reap_failed_writes()
        path, matched = self._walk(key, namespace)
        self._adopt_kept(path, key, matched, self.storage_seed(namespace), namespace)
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
        :data:`LOAD_BACK_THRESHOLD` tokens it is not worth a copy, nor when the
        cost model (:mod:`memsvc.core.hicache_cost`) finds recomputing it cheaper
        (both counted in ``load_skips``); otherwise device
        LRU leaves off the matched path are evicted for it, and if the device still
        cannot take all of it, none of it is loaded (the match stops at the device
        prefix and the request recomputes the rest). Storage nodes count with host
        ones: SGLang's storage pages reach the device through this same host load.
        """
        tail_len = sum(len(n.key) for n in tail)
        if not tail_len:
            return []
        num_pages = tail_len // self.page_size
        why = None
        if tail_len < LOAD_BACK_THRESHOLD:
            why = "threshold"
        elif not self.cost.worth_loading(tail_len, self._load_bytes(tail)):
            why = "cost"
        if why is not None:
            self.stats.load_skips[why] += 1
            self.stats.load_skip_tokens[why] += tail_len
            return []
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

    def _load_bytes(self, tail: list[TreeNode]) -> int:
        """The bytes loading ``tail`` back copies (the cost model's ``tail_bytes``)."""
        return sum(len(n.key) for n in tail) // self.page_size * self.page_bytes

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
            fence = self.copies.from_host(node.host_pages.copy(), pages)
        else:
            keys = list(self._hashes(node))
            fence = self.copies.from_storage(self.storage, keys, pages)
            self.stats.storage_read_bytes += num_pages * self.page_bytes
        self.stats.load_bytes += num_pages * self.page_bytes
        self.stats.load_tokens += len(node.key)
        self.stats.loads += 1
        node.value = self.allocator.pages_to_slots(pages)
        node.load_fence = fence
        self.events.stored(node, DEVICE)
        self._num_evictable_tokens += len(node.key)  # off-device nodes are never locked
        if node.namespace:
            self._count_namespace(node.namespace, len(node.key))
        self._touch(node)

    # -- insert and back up (the write policies) ------------------------------------

    def _insert(
        self, key: np.ndarray, slots: np.ndarray, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[int, TreeNode, list[np.ndarray]]:
        """Insert; off-device nodes on the path take the caller's slots (its KV is the same)."""
        path, matched = self._walk(key, namespace)
        num_device = 0
        while num_device < len(path) and path[num_device].value.size:
            num_device += 1
        device_len = sum(len(n.key) for n in path[:num_device])
        at = device_len
        for node in path[num_device:]:
            node.value = slots[at : at + len(node.key)].copy()
            node.load_fence = None
            self.events.stored(node, DEVICE)
            self._num_evictable_tokens += len(node.key)
            if namespace:
                self._count_namespace(namespace, len(node.key))
            self._touch(node)
            at += len(node.key)
        node = path[-1] if path else self.root
        values = [n.value for n in path]
        new = list(path[num_device:])
        if matched < len(key):
            leaf = self._new_node(key[matched:].copy(), slots[matched:].copy(), node)
            leaf.last_access_time = self._clock
            if namespace:
                leaf.namespace = namespace
                self._count_namespace(namespace, len(leaf.key))
            node.children[self._edge_key(leaf)] = leaf
            self._num_evictable_tokens += len(leaf.key)
            self._touch(leaf)
            values.append(leaf.value)
            node = leaf
            new.append(leaf)
            self.events.stored(leaf, DEVICE)
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

    def backup_prefix(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Give every device node on ``token_ids``' cached path (in ``namespace``) a host
        copy; returns bytes."""
        path, _ = self._walk(self._as_key(token_ids), check_namespace(namespace))
        before = self.stats.backup_bytes
        protect = set(map(id, path))
        for node in path:
            if node.value.size and node.host_pages is None:
                self._backup(node, protect)
        return self.stats.backup_bytes - before

    # -- device eviction -------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise InvalidArgumentError(f"cannot evict {num_tokens} tokens")
        return self._evict_device(num_tokens, set()) if num_tokens else 0

    def _evict_from(self, heap: EvictionHeap, num_tokens: int) -> int:
        return self._evict_device(num_tokens, set(), heap)

    def _evict_device(
        self, num_tokens: int, protect: set[int], heap: EvictionHeap | None = None
    ) -> int:
        """Free device leaves, LRU first (those ``heap`` pops: default, all the device's);
        a leaf keeps its host / storage copy if it has one."""
        leaves = self._free_leaves if heap is None else heap
        evicted = 0
        while evicted < num_tokens and (node := leaves.pop()) is not None:
            if self._load_state(node) == "failed":
                self.split_failed(node)  # its good pages stay, in a node of their own
            parent = node.parent
            evicted += len(node.key)
            self._evict_device_node(node, protect)
            if node.parent is not None:  # (dropped: _drop_subtree recorded the parent)
                self._touch(parent)  # a device leaf now, maybe
            if heap is not None:
                heap.push(parent)
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
        self.events.removed(node, DEVICE)
        slots = node.value
        node.value = _EMPTY
        node.load_fence = None
        self._num_evictable_tokens -= len(node.key)
        if node.namespace:
            self._count_namespace(node.namespace, -len(node.key))
        self._touch(node)  # its host copy now ranks before those of device nodes
        self.allocator.free(slots)  # pending behind any copy still reading or writing them
        if node.host_pages is None and not node.on_disk:
            self._drop_subtree(node)

    def flush(self, *, device_only: bool = False, namespace: str | None = None) -> int:
        """SGLang's flush_cache: every unlocked device node evicted and (unless
        ``device_only``) every copy off the device (host and storage) dropped; locked
        paths stay on the device, copies freed. Returns the device tokens evicted.
        With ``namespace``: that namespace's nodes alone, in every tier."""
        if namespace is not None:
            return self._flush_namespace(check_namespace(namespace), device_only=device_only)
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
        self.drop_kept()
        for node in self.iter_nodes():  # what is left is on the device: drop its copies
            if node.host_pages is not None:
                self._free_host(node)
            if node.on_disk:
                self._delete_storage(node)
        if not self.root.children:
            self.events.cleared()
        return evicted

    def _flush_namespace(self, namespace: str, *, device_only: bool) -> int:
        """:meth:`flush` of one namespace's subtrees. Kept storage pages no node holds
        yet (``--hicache-storage-keep``) are all dropped: whose they are is not known
        without their prefix."""
        self.reap_failed_writes()
        evicted = self.evict_namespace(namespace, self.total_size())
        if device_only:
            return evicted
        tops = [
            n
            for n in self.namespace_nodes(namespace)
            if not n.value.size and (n.parent is self.root or n.parent.value.size)
        ]
        for node in tops:
            self._drop_subtree(node)
        self.drop_kept()
        for node in self.namespace_nodes(namespace):  # left: on the device, locked
            if node.host_pages is not None:
                self._free_host(node)
                self._touch(node)
            if node.on_disk:
                self._delete_storage(node)
                self._touch(node)
        return evicted

    # -- sizes and stats -------------------------------------------------------------

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
            "load_skips": dict(s.load_skips),
            "load_skip_tokens": dict(s.load_skip_tokens),
            "load_cost_model": self.cost.as_dict(),
        }
