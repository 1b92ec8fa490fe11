"""Radix prefix cache: token-id prefixes mapped to the KV slots that hold them.

Page-aligned: keys are cut to a multiple of ``page_size``, so every node covers
whole pages (``value[i*ps:(i+1)*ps]`` is one page, in order) and children are
found by their first page of token ids. A running request locks the deepest
node of its prefix, pinning the path to the root; tokens in locked nodes are
*protected*, the rest *evictable*. ``evict`` frees unlocked leaves, least
recently used first by a logical clock, so the order is deterministic. It pops
them from a heap of free leaves kept up to date as the tree changes
(:mod:`memsvc.core.evict_heap`), so it costs O(log n) a leaf, never a walk.

Cache namespaces (:mod:`memsvc.namespace`): every node belongs to one, and two
requests share a node only if their namespaces are equal. The tree is a forest
under one root: the root files a child under its first page's token ids, a
child of another namespace than the default under the namespace's digest and
that first page (so the default namespace's keys, and cost, are unchanged);
every node below inherits its parent's namespace. Counting, flushing and capping
each namespace's device tokens is :mod:`memsvc.core.radix_namespaces`'.

Ownership: ``insert`` takes the slots of the new part of the key and never
frees; the caller frees its duplicates of the part already cached. Only
``evict`` and the ``cache_*_req`` hand-backs free slots. A hand-back that
inserts must give the locked path's own tokens for the protected prefix (the
tree's slots are filed under no other key). A call that raises
``InvalidArgumentError`` has changed nothing. The calls the pool makes, and
what each may change, are :class:`~memsvc.core.prefix_cache.PrefixCache`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE, PageAllocator
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.evict_heap import EvictionHeap, lru_rank
from memsvc.core.fence import CopyFence
from memsvc.core.prefix_cache import CacheHit, PrefixCache, common_prefix_len
from memsvc.core.radix_check import TreeChecks
from memsvc.core.radix_namespaces import NamespaceCounts, check_namespace
from memsvc.core.tree_events import DEVICE, NULL_TREE_EVENTS, NullTreeEvents
from memsvc.namespace import DEFAULT_NAMESPACE

_EMPTY = np.empty(0, dtype=SLOT_DTYPE)


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the tree: token ids ``key`` whose KV lives in slots ``value``."""

    key: np.ndarray
    value: np.ndarray
    parent: TreeNode | None = field(repr=False)
    node_id: int  # creation order; breaks LRU ties deterministically
    children: dict[bytes, TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access_time: int = 0
    namespace: str = DEFAULT_NAMESPACE  # its cache namespace (memsvc.namespace)
    event_hashes: list[bytes] | None = field(default=None, repr=False)  # tree_events.py


@dataclass(frozen=True, slots=True, eq=False)
class MatchResult:
    slots: np.ndarray  # tree slots of the matched prefix; a copy, page multiple long
    last_node: TreeNode  # deepest matched node, the root if nothing matched


@dataclass(frozen=True, slots=True, eq=False)
class CachedPrefix:
    slots: np.ndarray  # the request's new slot row: tree slots, then its own unaligned tail
    protected_len: int  # tokens of ``slots`` that now belong to the tree
    last_node: TreeNode  # the node the request now holds locked


def _as_int_array(values: object, what: str) -> np.ndarray:
    try:
        array = np.asarray(values)
    except ValueError as exc:  # ragged nested lists
        raise InvalidArgumentError(f"{what} must be a 1-D integer array: {exc}") from exc
    if array.ndim != 1:
        raise InvalidArgumentError(f"{what} must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgumentError(f"{what} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


class RadixCache(NamespaceCounts, TreeChecks, PrefixCache):
    """Prefix tree of token ids over a ``PageAllocator``'s slots. Synchronous, no I/O."""

    def __init__(self, allocator: PageAllocator, *, disabled: bool = False) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.disabled = disabled
        self._page_offsets = np.arange(self.page_size, dtype=SLOT_DTYPE)
        self._clock = 0
        self._num_nodes_created = 0
        self._num_evictable_tokens = 0
        self._num_protected_tokens = 0
        self.root = self._new_node(_EMPTY, _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted nor counted
        self._free_leaves = EvictionHeap(lru_rank, self._is_free_leaf)
        self._init_namespaces()
        self.events: NullTreeEvents = NULL_TREE_EVENTS  # KV events (memsvc.core.tree_events)

    # -- sizes -----------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._num_evictable_tokens

    def protected_size(self) -> int:
        return self._num_protected_tokens

    def total_size(self) -> int:
        return self._num_evictable_tokens + self._num_protected_tokens

    # -- lookup and insert ----------------------------------------------------

    def match_prefix(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> MatchResult:
        """Longest cached page-aligned prefix. Splits a node the match ends inside of."""
        key = self._as_key(token_ids)
        check_namespace(namespace)
        if self.disabled:
            return MatchResult(_EMPTY.copy(), self.root)
        path, _ = self._walk(key, namespace)
        slots = np.concatenate([n.value for n in path]) if path else _EMPTY.copy()
        return MatchResult(slots, path[-1] if path else self.root)

    def match_and_load(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> CacheHit:
        """:meth:`match_prefix`: this cache has no lower tier to load from."""
        match = self.match_prefix(token_ids, namespace)
        return CacheHit(match.slots, match.last_node, int(match.slots.size), 0, 0, [])

    def insert(self, token_ids: object, slots: object, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Insert the page-aligned part of the key; return how many tokens were already cached.

        The tree takes ownership of ``slots[prefix_len:K]``; the caller still owns
        (and must free) ``slots[:prefix_len]`` and anything past ``K``.
        """
        key = self._as_key(token_ids)
        slots = _as_int_array(slots, "slots")
        if len(slots) < len(key):
            raise InvalidArgumentError(f"{len(slots)} slots for a {len(key)}-token key")
        slots = slots[: len(key)]
        self._check_page_runs(slots, "slots")
        check_namespace(namespace)
        if self.disabled:
            return 0
        prefix_len = self._insert(key, slots, namespace)[0]
        self._enforce_cap(namespace)
        return prefix_len

    # -- locks ---------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors against eviction (the root is always pinned)."""
        self._check_attached(node)
        while node is not self.root:
            if node.lock_ref == 0:
                self._num_evictable_tokens -= len(node.key)
                self._num_protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        self._check_attached(node)
        # Ancestors hold at least the node's count, so checking the node covers the path.
        if node is not self.root and node.lock_ref == 0:
            raise InvalidArgumentError(f"unlock of node {node.node_id}, which is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_protected_tokens -= len(node.key)
                self._num_evictable_tokens += len(node.key)
                self._touch(node)
            node = node.parent

    # -- eviction --------------------------------------------------------------

    def flush(self, *, device_only: bool = False, namespace: str | None = None) -> int:
        """Evict every unlocked node (the device is the only tier); with ``namespace``,
        only that namespace's."""
        if namespace is not None:
            return self.evict_namespace(check_namespace(namespace), self.total_size())
        evicted = self.evict(self.evictable_size())
        if not self.root.children:
            self.events.cleared()
        return evicted

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` are freed.

        Returns the tokens freed: at least ``num_tokens`` (whole nodes go), or all
        that was evictable.
        """
        if num_tokens < 0:
            raise InvalidArgumentError(f"cannot evict {num_tokens} tokens")
        if num_tokens == 0:
            return 0
        return self._evict_from(self._free_leaves, num_tokens)

    def _evict_from(self, heap: EvictionHeap, num_tokens: int) -> int:
        """Evict the leaves ``heap`` pops until ``num_tokens`` are freed (or none is left)."""
        num_evicted = 0
        freed_values = []
        while num_evicted < num_tokens and (leaf := heap.pop()) is not None:
            parent = leaf.parent
            self.events.removed(leaf, DEVICE)
            del parent.children[self._edge_key(leaf)]
            leaf.parent = None  # marks it detached: lock/unlock refuse it from now on
            freed_values.append(leaf.value)
            num_evicted += len(leaf.key)
            if leaf.namespace:
                self._count_namespace(leaf.namespace, -len(leaf.key))
            self._touch(parent)  # a leaf now, maybe
            if heap is not self._free_leaves:
                heap.push(parent)
        self._num_evictable_tokens -= num_evicted
        if freed_values:
            self.allocator.free(np.concatenate(freed_values))
        return num_evicted

    # -- requests handing their KV back ----------------------------------------

    def cache_finished_req(
        self,
        token_ids: object,
        kv_slots: object,
        protected_len: int,
        last_node: TreeNode,
        *,
        is_insert: bool,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> None:
        """A request is done with its KV: keep what the tree wants, free the rest, unlock.

        ::

            kv_slots  |<- tree's, locked ->|<- request's own, whole pages ->|<- tail ->|
                      0            protected_len                            K          L
            is_insert:  [protected_len, new_prefix_len) duplicates: freed
                        [new_prefix_len, K) moves into the tree
            otherwise:  [protected_len, K) freed (retract: generated KV is not cached)
            both:       [K, L) freed; last_node unlocked
        """
        keys, kv_slots = self._check_request(
            token_ids, kv_slots, protected_len, last_node, is_insert=is_insert, namespace=namespace
        )
        if is_insert and not self.disabled:
            new_prefix_len = self._insert(keys, kv_slots[: len(keys)], namespace)[0]
            released = np.concatenate(
                [kv_slots[protected_len:new_prefix_len], kv_slots[len(keys) :]]
            )
        else:
            released = kv_slots[protected_len:]
        self.allocator.free(released)
        self.unlock(last_node)
        if is_insert:
            self._enforce_cap(namespace)

    def cache_unfinished_req(
        self,
        token_ids: object,
        kv_slots: object,
        protected_len: int,
        last_node: TreeNode,
        *,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> CachedPrefix:
        """A running request publishes its page-aligned prefix and keeps running on the tree's copy.

        ::

            kv_slots  |<- tree's ->|<- own: dups freed, rest into tree ->|<- tail, kept ->|
                      0     protected_len                                K                L
            returned  |<------------- tree slots, locked ------------->|<- tail ------->|
        """
        keys, kv_slots = self._check_request(
            token_ids, kv_slots, protected_len, last_node, is_insert=True, namespace=namespace
        )
        if self.disabled:
            return CachedPrefix(kv_slots, protected_len, last_node)
        aligned_len = len(keys)
        new_prefix_len, new_last_node, values = self._insert(
            keys, kv_slots[:aligned_len], namespace
        )
        self.allocator.free(kv_slots[protected_len:new_prefix_len])
        # Lock the new path first so the shared part never drops to 0 in between.
        self.lock(new_last_node)
        self.unlock(last_node)
        self._enforce_cap(namespace)  # (the request's own path is locked)
        slots = np.concatenate([*values, kv_slots[aligned_len:]])
        return CachedPrefix(slots, aligned_len, new_last_node)

    # -- loads and backups: none without a lower tier --------------------------------

    def wait_load(self, node: TreeNode, fence: CopyFence) -> bool:
        """No load of this cache ever fails: it hands out none."""
        fence.wait()
        return False

    def failed_loads_above(self, nodes: Iterable[TreeNode]) -> list[TreeNode]:
        """None: no node of this cache is ever loaded."""
        return []

    def discard_failed(self, nodes: Iterable[TreeNode]) -> None:
        """Nothing to drop: no node of this cache is ever loaded."""

    def check_can_back_up(self) -> None:
        raise InvalidArgumentError(
            "retracting into the tree needs the hierarchical cache (--enable-hierarchical-cache)"
        )

    def backup_prefix(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> int:
        self.check_can_back_up()
        return 0

    def backup_bytes(self) -> int:
        return 0

    def settle(self) -> None:
        """Nothing to wait for: this cache issues no copies."""

    def close(self) -> None:
        """Nothing to release beyond the pool's own buffers."""

    # -- integrity ---------------------------------------------------------------

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_idle(self) -> None:
        """Nothing beyond :meth:`check`: this cache has no lower tier."""

    # -- internals -----------------------------------------------------------------

    def _new_node(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> TreeNode:
        self._num_nodes_created += 1
        return TreeNode(key, value, parent, self._num_nodes_created)

    def _page_key(self, key: np.ndarray, start: int = 0) -> bytes:
        return key[start : start + self.page_size].tobytes()

    def _edge_key(self, node: TreeNode) -> bytes:
        """The key ``node`` is filed under in its parent's children: its first page, and
        under the root a non-default namespace's digest in front (32 bytes: never a
        default key's length, a whole number of 8-byte token ids)."""
        page = node.key[: self.page_size].tobytes()
        if node.namespace and node.parent is self.root:
            return node.namespace.encode() + page
        return page

    def _as_key(self, token_ids: object) -> np.ndarray:
        token_ids = _as_int_array(token_ids, "token_ids")
        return token_ids[: len(token_ids) - len(token_ids) % self.page_size]

    def _walk(
        self, key: np.ndarray, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[list[TreeNode], int]:
        """Walk ``key`` as far as it matches, refreshing access times and splitting the
        last node if the match ends inside it; return (path of nodes, matched_len).

        Every node visited is stamped before it is split (as SGLang does), so
        both halves of a split are fresh: the lower half was touched too.
        """
        self._clock += 1
        node, matched_len, path = self.root, 0, []
        # Under the root, a non-default namespace's edges carry its digest (_edge_key).
        edge = namespace.encode() + self._page_key(key) if namespace else self._page_key(key)
        while matched_len < len(key):
            child = node.children.get(edge)
            if child is None:
                break
            child.last_access_time = self._clock
            common = common_prefix_len(child.key, key[matched_len:], self.page_size)
            if common < len(child.key):
                child = self._split(child, common)  # records both halves at the new time
            else:
                self._touch(child)
            path.append(child)
            matched_len += common
            node = child
            edge = self._page_key(key, matched_len)
        return path, matched_len

    def _insert(
        self, key: np.ndarray, slots: np.ndarray, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[int, TreeNode, list[np.ndarray]]:
        """Insert validated arrays; return (already-cached length, deepest node, path values)."""
        path, prefix_len = self._walk(key, namespace)
        node, values = path[-1] if path else self.root, [n.value for n in path]
        if prefix_len < len(key):
            # Copies: the caller may reuse its arrays, the tree must not see that.
            leaf = self._new_node(key[prefix_len:].copy(), slots[prefix_len:].copy(), node)
            leaf.last_access_time = self._clock
            if namespace:
                leaf.namespace = namespace
                self._count_namespace(namespace, len(leaf.key))
            node.children[self._edge_key(leaf)] = leaf
            self._num_evictable_tokens += len(leaf.key)
            self._touch(leaf)
            values.append(leaf.value)
            node = leaf
            self.events.stored(leaf, DEVICE)
        return prefix_len, node, values

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut ``node`` after ``split_len`` tokens; return the new upper half.

        ``node`` keeps the lower half, so a request holding it as its last node
        still ends at the same token. Copying lock_ref keeps the counters right.
        """
        upper = self._new_node(node.key[:split_len], node.value[:split_len], node.parent)
        upper.lock_ref = node.lock_ref
        upper.last_access_time = node.last_access_time
        upper.namespace = node.namespace
        node.parent.children[self._edge_key(upper)] = upper
        node.key = node.key[split_len:]
        node.value = node.value[split_len:]
        node.parent = upper
        upper.children[self._page_key(node.key)] = node
        self.events.split(upper, node)
        self._touch(upper)
        self._touch(node)
        return upper

    def _is_free_leaf(self, node: TreeNode) -> bool:
        return (
            node.parent is not None  # neither the root nor evicted
            and not node.children
            and node.lock_ref == 0
        )

    def _touch(self, node: TreeNode) -> None:
        """``node`` may have become evictable or changed its LRU rank: record it (each
        eviction heap checks whether it is a candidate there)."""
        self._free_leaves.push(node)
        if self.namespace_cap and node.namespace:
            self._push_namespace_leaf(node)

    def _check_eviction_heaps(self) -> None:
        self._check_heap(self._free_leaves, self._is_free_leaf, "free leaves")
        self._check_namespace_heaps()

    def _check_attached(self, node: TreeNode) -> None:
        if node.parent is None and node is not self.root:
            raise InvalidArgumentError(f"node {node.node_id} is not in the tree (evicted?)")

    def path_key(self, node: TreeNode) -> np.ndarray:
        """The token ids from the root down to the end of ``node``. Changes nothing."""
        self._check_attached(node)
        keys = []
        while node is not self.root:
            keys.append(node.key)
            node = node.parent
        return np.concatenate(keys[::-1]) if keys else np.empty(0, dtype=np.int64)

    def _check_page_runs(self, slots: np.ndarray, what: str) -> None:
        """Slots must lie in the pool, each page's run being that whole page in order."""
        self.allocator.check_slots(slots)
        if self.page_size == 1 or not slots.size:
            return
        runs = slots.reshape(-1, self.page_size)
        if (runs[:, 0] % self.page_size).any() or (runs - runs[:, :1] != self._page_offsets).any():
            raise InvalidArgumentError(f"{what}: each page-sized run must be one whole page")

    def _check_request(
        self,
        token_ids: object,
        kv_slots: object,
        protected_len: int,
        last_node: TreeNode,
        *,
        is_insert: bool,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validate a request hand-back; return (page-aligned keys, kv_slots).

        Only a hand-back that inserts reads the token ids' values (a retract
        passes placeholders of the right length).
        """
        token_ids = _as_int_array(token_ids, "token_ids")
        kv_slots = _as_int_array(kv_slots, "kv_slots")
        if len(kv_slots) != len(token_ids):
            raise InvalidArgumentError(f"{len(kv_slots)} kv_slots for {len(token_ids)} tokens")
        keys = self._as_key(token_ids)
        if not 0 <= protected_len <= len(keys) or protected_len % self.page_size:
            raise InvalidArgumentError(
                f"protected_len {protected_len} must be a page multiple in 0..{len(keys)}"
            )
        # The locked node must end exactly where the tree's slots end, or the
        # ranges freed below would include slots the tree owns.
        locked_key = self.path_key(last_node)
        if len(locked_key) != protected_len:
            raise InvalidArgumentError(
                f"last_node ends at {len(locked_key)}, protected_len {protected_len}"
            )
        if last_node is not self.root and last_node.lock_ref == 0:
            raise InvalidArgumentError(f"last_node {last_node.node_id} is not locked")
        check_namespace(namespace)
        if last_node is not self.root and last_node.namespace != namespace:
            raise InvalidArgumentError(
                f"last_node {last_node.node_id} is in another cache namespace"
            )
        # The tree walks ``keys`` to insert: tokens other than the locked path's
        # would file the tree's own slots under a second key (a page in two nodes).
        if is_insert and not np.array_equal(keys[:protected_len], locked_key):
            raise InvalidArgumentError(
                f"token_ids[:{protected_len}] differ from the locked prefix the request holds"
            )
        self._check_page_runs(kv_slots[protected_len : len(keys)], "kv_slots")
        self.allocator.check_slots(kv_slots[len(keys) :])
        return keys, kv_slots
