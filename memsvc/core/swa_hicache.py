"""The hierarchical cache of a hybrid (sliding-window) model: host copies keep SWA KV too.

:class:`SWAHiRadixCache` is :class:`~memsvc.core.hicache.HiRadixCache` (device, host and
storage tiers) with :class:`~memsvc.core.swa_radix_cache.SWARadixCache`'s SWA rules on
the device (per-page tombstones, window pins, :meth:`evict_swa`, a match cut to where
its SWA tail is held). Off the device, per page::

    host copy of a node   full KV of every page  +  SWA KV of the pages that held it
                          (host_swa: an SWA host-arena page, or -1: a tombstone copy)
    storage copy          full KV only (a storage page has no SWA KV)

A backup copies a device node's SWA pages with its full pages (synchronously: the SWA
pool has no pending pages, so no copy may read it after the op); a load gives the node
fresh full and SWA pages, copies the SWA KV back where the host copy has it and frees
the other SWA pages (tombstones). A match over the tiers is cut to the longest
page-aligned length whose SWA tail (the last ``W`` tokens, page aligned) holds SWA KV
in the tier it is loaded from: a host or storage hit restores a prefix together with
its SWA tail, or it is not a hit. The SWA host arena has as many pages as the host
tier (a host SWA page always belongs to a node with a host copy).

A pure sliding-window layout (every layer windowed) works the same way with full pages
of no bytes: a host copy is its SWA KV alone (full host pages are ids, 0-byte copies),
the host tier is sized and the load cost model timed by SWA bytes, and the storage tier
is refused (it would hold full KV only: nothing). The cost model prices a load at its
full bytes plus the SWA bytes its host copies hold (:meth:`_load_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from memsvc.core.backends.base import KVBuffers, page_runs
from memsvc.core.errors import IntegrityError, InvalidArgumentError
from memsvc.core.hicache import HiRadixCache, HiTreeNode
from memsvc.core.hicache_config import HiCacheConfig
from memsvc.core.hicache_cost import LoadCostModel
from memsvc.core.hicache_tiers import HostTier
from memsvc.core.prefix_cache import CacheHit
from memsvc.core.radix_cache import TreeNode, check_namespace
from memsvc.core.storage import StorageBackend
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_host_store import SWABuffersView
from memsvc.core.swa_radix_cache import SWARadixCache
from memsvc.namespace import DEFAULT_NAMESPACE


@dataclass(slots=True, eq=False)
class SWAHiTreeNode(HiTreeNode):
    host_swa: np.ndarray | None = None  # per page of the host copy: SWA host page, -1: none


def swa_valid_len(has_swa: np.ndarray, page_size: int, sliding_window: int) -> int:
    """The longest page-aligned prefix whose SWA tail pages all hold SWA KV (``has_swa``:
    per page). The rule of :meth:`SWARadixCache.swa_valid_len`."""
    if has_swa.all():
        return int(has_swa.size) * page_size
    ends = np.arange(1, has_swa.size + 1)
    last_tombstone = np.maximum.accumulate(np.where(has_swa, 0, ends))
    needed = ends - np.maximum(ends * page_size - sliding_window, 0) // page_size
    valid = ends[ends - last_tombstone >= needed]
    return int(valid[-1]) * page_size if valid.size else 0


class SWAHiRadixCache(SWARadixCache, HiRadixCache):
    """See the module docstring."""

    allocator: SWAPageAllocator

    def __init__(
        self,
        allocator: SWAPageAllocator,
        buffers: KVBuffers,
        config: HiCacheConfig,
        sliding_window: int,
        *,
        storage: StorageBackend | None = None,
        storage_seed: Callable[[str], str] | None = None,
    ) -> None:
        if sliding_window < 1:
            raise InvalidArgumentError(f"sliding_window must be >= 1, got {sliding_window}")
        self._swa_view = SWABuffersView(buffers)
        self._swa_page_bytes = self._swa_view.layout.bytes_per_page
        # A pure sliding-window layout: full pages hold no bytes (every position still
        # gets a full page id); a prefix's KV is its SWA tail's alone.
        self.pure_swa = not buffers.layout.bytes_per_page
        if self.pure_swa and (storage is not None or config.storage_backend is not None):
            raise InvalidArgumentError(
                "the hierarchical cache's storage tier keeps full KV only, and a pure "
                "sliding-window model has none (drop --hicache-storage-backend)"
            )
        HiRadixCache.__init__(
            self, allocator, buffers, config, storage=storage, storage_seed=storage_seed
        )
        self.sliding_window = sliding_window
        self._pins = np.zeros(allocator.num_pages + 1, dtype=np.int32)
        self._num_pinned_pages = 0
        self.swa_host = HostTier(self._swa_view, self.host.num_pages)
        self._swa_kv = buffers.swa_kv
        if self.pure_swa:  # a load copies SWA pages alone: time that copy
            self.cost = LoadCostModel.for_config(
                config, self._swa_view, self.swa_host.arena, allocator.swa.num_pages
            )

    def _host_num_pages(self, config: HiCacheConfig, device_pages: int) -> int:
        if self.pure_swa:  # the host tier's bytes are its SWA arena's
            return config.host_pages(device_pages, self._swa_page_bytes)
        return super()._host_num_pages(config, device_pages)

    def _cost_model(self, config: HiCacheConfig, device_pages: int) -> LoadCostModel:
        if self.pure_swa:  # no full bytes to time: __init__ times the SWA copy instead
            return LoadCostModel(enabled=False, copy_latency_s=0.0, copy_bytes_per_s=1.0)
        return super()._cost_model(config, device_pages)

    def _load_bytes(self, tail: list[TreeNode]) -> int:
        """Full bytes of every page plus the SWA bytes of the pages whose host copy has them."""
        return super()._load_bytes(tail) + self._swa_page_bytes * sum(
            int((n.host_swa >= 0).sum())
            for n in tail
            if n.host_pages is not None and n.host_swa is not None
        )

    def stats_dict(self) -> dict[str, Any]:
        out = super().stats_dict()
        out["swa_host_capacity_bytes"] = self.swa_host.num_pages * self._swa_page_bytes
        out["swa_host_used_bytes"] = self.swa_host.used_pages * self._swa_page_bytes
        return out

    def _new_node(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> TreeNode:
        self._num_nodes_created += 1
        return SWAHiTreeNode(key, value, parent, self._num_nodes_created)

    # -- match over the tiers -----------------------------------------------------------

    def _has_swa(self, path: list[TreeNode]) -> np.ndarray:
        """Per page of ``path``: whether the tier a match would use holds its SWA KV."""
        ps, f2s = self.page_size, self.allocator.full_to_swa_page
        parts = []
        for node in path:
            if node.value.size:
                parts.append(f2s[node.value[::ps] // ps] != 0)
            elif node.host_pages is not None and node.host_swa is not None:
                parts.append(node.host_swa >= 0)
            else:  # storage only: no SWA KV
                parts.append(np.zeros(len(node.key) // ps, dtype=bool))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)

    def match_and_load(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> CacheHit:
        """:meth:`HiRadixCache.match_and_load` of the longest prefix whose SWA tail is held
        in the tier it comes from; if the off-device part is not loaded after all, the
        device part is cut to its own SWA tail rule the same way."""
        key = self._as_key(token_ids)
        path, _ = self._walk(key, check_namespace(namespace))
        valid = swa_valid_len(self._has_swa(path), self.page_size, self.sliding_window)
        hits_before = dict(self.stats.hit_tokens)
        hit = HiRadixCache.match_and_load(self, key[:valid], namespace)
        device_valid = self.swa_valid_len(hit.slots)
        if device_valid == hit.slots.size:
            return hit
        # nothing off the device was loaded and the device part's tail is a tombstone
        assert not hit.host_tokens and not hit.storage_tokens
        self.stats.hit_tokens.update(hits_before)  # counted once, by the call below
        return HiRadixCache.match_and_load(self, key[:device_valid], namespace)

    # -- the host tier's SWA copies ----------------------------------------------------

    def _backup(self, node: TreeNode, protect: set[int]) -> bool:
        if not super()._backup(node, protect):
            return False
        ps = self.page_size
        swa_pages = self.allocator.full_to_swa_page[node.value[::ps] // ps].astype(np.int64)
        held = swa_pages != 0
        host_swa = np.full(swa_pages.size, -1, dtype=np.int64)
        pages = self.swa_host.alloc(int(held.sum()))
        if pages is not None:  # (always: one SWA host page per host page at most)
            host_swa[held] = pages
            self.swa_host.arena[pages] = self._swa_kv[swa_pages[held]]
            self.stats.backup_bytes += pages.size * self._swa_page_bytes
        node.host_swa = host_swa
        return True

    def _free_host(self, node: TreeNode) -> None:
        super()._free_host(node)
        if node.host_swa is not None:
            held = node.host_swa[node.host_swa >= 0]
            self.swa_host.free(held)
            if self.zero_freed_host and node.namespace:  # --zero-freed-kv: salted KV
                self.copies.zero_host(self.swa_host.arena, held)
            node.host_swa = None

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        upper = super()._split(node, split_len)
        if node.host_swa is not None:
            num_pages = split_len // self.page_size
            upper.host_swa = node.host_swa[:num_pages]
            node.host_swa = node.host_swa[num_pages:]
        return upper

    def _load(self, node: TreeNode) -> None:
        """Fresh full and SWA pages; the SWA KV copied back where the host copy has it,
        the other SWA pages freed (tombstones; a storage copy has none)."""
        super()._load(node)
        ps = self.page_size
        pages = node.value[::ps] // ps
        has = np.zeros(pages.size, dtype=bool)
        if node.host_pages is not None and node.host_swa is not None:
            has = node.host_swa >= 0
            swa_pages = self.allocator.full_to_swa_page[pages[has]].astype(np.int64)
            host = node.host_swa[has]
            for index, first, length in page_runs(host):
                dest = swa_pages[index : index + length]
                self._swa_kv[dest] = self.swa_host.arena[first : first + length]
            self.stats.load_bytes += host.size * self._swa_page_bytes
        self.allocator.free_swa_pages(pages[~has])

    # -- integrity --------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        held = []
        for node in self.iter_nodes():
            if node.host_swa is None:
                continue
            if node.host_pages is None or node.host_swa.size != node.host_pages.size:
                raise IntegrityError(f"node {node.node_id}: SWA host copy without its host copy")
            held.append(node.host_swa[node.host_swa >= 0])
        pages = np.concatenate(held) if held else np.empty(0, np.int64)
        if np.unique(pages).size != pages.size or pages.size != self.swa_host.used_pages:
            raise IntegrityError(
                f"SWA host arena: nodes hold {pages.size} pages, {self.swa_host.used_pages} in use"
            )
