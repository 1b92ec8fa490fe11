"""The prefix cache's interface: what the pool asks of its tree, and what each call changes.

Like mini-sglang's ``BasePrefixCache``: one small set of calls that the pool
(:class:`~memsvc.core.pool.KVPool`) makes, implemented by
:class:`~memsvc.core.radix_cache.RadixCache` over the device pool and by
:class:`~memsvc.core.hicache.HiRadixCache` over the device, host and storage
tiers. The pool never asks which one it holds. Each call's docstring says
whether it may change the cache; a call that raises
:class:`~memsvc.core.errors.InvalidArgumentError` has changed nothing.

Ownership of slots (both caches): ``insert`` and the ``cache_*_req``
hand-backs take the slots of the new part of a key; only ``evict``,
``flush`` and the hand-backs free slots.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from memsvc.core.fence import CopyFence
    from memsvc.core.radix_cache import CachedPrefix, MatchResult, TreeNode


def common_prefix_len(a: np.ndarray, b: np.ndarray, page_size: int) -> int:
    """Length of the common prefix of two token-id keys, rounded down to whole pages."""
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    common = int(mismatch[0]) if mismatch.size else n
    return common - common % page_size


@dataclass
class CacheHit:
    """A match over every tier the cache has, its off-device part loading onto the device."""

    slots: np.ndarray  # device slots of the whole matched (and loaded) prefix
    last_node: TreeNode
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    # (node, fence) of every matched node whose load has not been seen to succeed: wait
    # on each before the pages are read; a failed one is dropped (KVPool.settle_loads).
    loads: list[tuple[TreeNode, CopyFence]]

    @property
    def load_pending(self) -> bool:
        return any(not fence.done() for _, fence in self.loads)


class PrefixCache(ABC):
    """Token-id prefixes mapped to the KV slots that hold them (see the module docstring)."""

    root: TreeNode
    page_size: int

    # -- sizes: change nothing ----------------------------------------------------

    @abstractmethod
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes. Changes nothing."""

    @abstractmethod
    def protected_size(self) -> int:
        """Device tokens in locked nodes. Changes nothing."""

    @abstractmethod
    def namespace_tokens(self) -> dict[str, int]:
        """Device tokens per cache namespace holding any, kept as nodes come and go.
        Changes nothing."""

    @abstractmethod
    def set_namespace_cap(self, max_tokens: int) -> None:
        """Cap each non-default namespace's device tokens (0: none), enforced after each
        insert by evicting that namespace's own LRU unlocked leaves."""

    def total_size(self) -> int:
        """Device tokens the cache holds. Changes nothing."""
        return self.evictable_size() + self.protected_size()

    # -- lookup and insert ------------------------------------------------------------

    @abstractmethod
    def match_prefix(self, token_ids: object, namespace: str = "") -> MatchResult:
        """The longest page-aligned prefix cached on the device, in cache ``namespace``
        (every call that takes one: nodes of another namespace are never shared).

        Changes the tree's shape (a node the match ends inside is split) and its
        LRU order; frees, allocates and copies nothing.
        """

    @abstractmethod
    def match_and_load(self, token_ids: object, namespace: str = "") -> CacheHit:
        """The longest page-aligned prefix in any tier, its off-device part loaded.

        Changes the cache: as :meth:`match_prefix`, and a cache with lower tiers
        may evict device leaves and issue copies into fresh device pages (the
        hit's ``loads``). The caller locks ``last_node`` before anything else
        can evict.
        """

    @abstractmethod
    def insert(self, token_ids: object, slots: object, namespace: str = "") -> int:
        """Insert the page-aligned part of the key; return how many tokens were cached.

        Changes the cache: it takes ownership of ``slots[prefix_len:K]``; the
        caller still owns ``slots[:prefix_len]`` and anything past ``K``.
        """

    @abstractmethod
    def path_key(self, node: TreeNode) -> np.ndarray:
        """The token ids from the root down to the end of ``node``. Changes nothing."""

    # -- locks: change lock counts only ---------------------------------------------

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors against eviction. Changes lock counts."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock` of ``node``. Changes lock counts."""

    # -- freeing ------------------------------------------------------------------------

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free unlocked device leaves, LRU first, until ``num_tokens`` are freed.

        Changes the cache; returns the device tokens freed.
        """

    @abstractmethod
    def flush(self, *, device_only: bool = False, namespace: str | None = None) -> int:
        """Evict every unlocked device node; unless ``device_only``, drop every copy in
        the lower tiers too; with ``namespace``, that namespace's alone. Changes the
        cache; returns the device tokens evicted."""

    @abstractmethod
    def cache_finished_req(
        self,
        token_ids: object,
        kv_slots: object,
        protected_len: int,
        last_node: TreeNode,
        *,
        is_insert: bool,
        namespace: str = "",
    ) -> None:
        """A request hands its KV back: keep what the cache wants, free the rest, unlock.

        Changes the cache.
        """

    @abstractmethod
    def cache_unfinished_req(
        self,
        token_ids: object,
        kv_slots: object,
        protected_len: int,
        last_node: TreeNode,
        *,
        namespace: str = "",
    ) -> CachedPrefix:
        """A running request publishes its page-aligned prefix and keeps running on the
        cache's copy. Changes the cache."""

    # -- loads and backups (no-ops for a device-only cache) --------------------------

    @abstractmethod
    def wait_load(self, node: TreeNode, fence: CopyFence) -> bool:
        """Wait for ``fence``, a load :meth:`match_and_load` handed out for ``node``;
        return whether it failed and ``node`` is still to be dropped
        (:meth:`failed_loads_above`). Changes the node's load state only."""

    @abstractmethod
    def failed_loads_above(self, nodes: Iterable[TreeNode]) -> list[TreeNode]:
        """The nodes from ``nodes`` up to the root whose load failed: the parts to drop.

        Changes the tree's shape: each is split after the pages its load verified.
        """

    @abstractmethod
    def discard_failed(self, nodes: Iterable[TreeNode]) -> None:
        """Drop nodes whose load failed, and all below them, from every tier.

        Changes the cache; the caller has released every request holding them.
        """

    @abstractmethod
    def check_can_back_up(self) -> None:
        """Raise :class:`InvalidArgumentError` unless :meth:`backup_prefix` can work here.

        Changes nothing.
        """

    @abstractmethod
    def backup_prefix(self, token_ids: object, namespace: str = "") -> int:
        """Give every device node on ``token_ids``' cached path a lower-tier copy.

        Changes the cache (may evict other copies for room); returns the bytes copied.
        """

    @abstractmethod
    def backup_bytes(self) -> int:
        """Bytes copied to a lower tier so far (0 for a device-only cache). Changes nothing."""

    @abstractmethod
    def settle(self) -> None:
        """Wait for every copy issued so far. Changes nothing in the tree."""

    @abstractmethod
    def close(self) -> None:
        """Wait for copies and release the lower tiers. The cache is unusable after."""

    # -- integrity: change nothing ---------------------------------------------------

    @abstractmethod
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children. Changes nothing."""

    @abstractmethod
    def check(self) -> None:
        """Raise :class:`IntegrityError` unless the tree's shape, locks and counters
        agree. Changes nothing."""

    @abstractmethod
    def check_idle(self) -> None:
        """:meth:`check`'s extra for an idle pool (the lower tiers' files match the tree).

        Waits for copies; changes nothing in the tree.
        """
