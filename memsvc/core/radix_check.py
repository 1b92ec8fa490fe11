"""The radix tree's integrity check (:meth:`RadixCache.check`), apart from the calls that
change the tree: its shape, locks, counters and eviction heaps. Changes nothing.

:class:`TreeChecks` is a mixin of :class:`~memsvc.core.radix_cache.RadixCache`;
:class:`~memsvc.core.hicache_tree.TieredTree` builds its own ``check`` from the same parts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.errors import IntegrityError, InvalidArgumentError

if TYPE_CHECKING:
    from memsvc.core.evict_heap import EvictionHeap
    from memsvc.core.radix_cache import TreeNode


class TreeChecks:
    """The checks, over the attributes and helpers :class:`RadixCache` defines."""

    root: TreeNode
    page_size: int
    disabled: bool
    _num_evictable_tokens: int
    _num_protected_tokens: int
    _ns_tokens: dict[str, int]
    _ns_leaves: dict[str, EvictionHeap]
    namespace_cap: int

    if TYPE_CHECKING:

        def iter_nodes(self) -> Iterator[TreeNode]: ...
        def _edge_key(self, node: TreeNode) -> bytes: ...
        def _is_device_candidate(self, node: TreeNode) -> bool: ...
        def _check_page_runs(self, slots: np.ndarray, what: str) -> None: ...
        def _check_eviction_heaps(self) -> None: ...

    def check(self) -> None:
        """Raise ``IntegrityError`` unless the tree's shape, locks and counters agree.

        Which pages are where is the pool's check (it counts ``iter_nodes`` pages).
        """
        self._check_root()
        if self.disabled and self.root.children:
            raise IntegrityError("a disabled cache holds nodes")
        num_tokens = {True: 0, False: 0}  # by "is locked"
        for node, where in self._checked_nodes():
            if len(node.key) != len(node.value):
                raise IntegrityError(
                    f"{where}: key/value lengths {len(node.key)}/{len(node.value)}"
                )
            self._count_device_node(node, where, num_tokens)
        self._check_counters(num_tokens)
        self._check_eviction_heaps()

    def _check_root(self) -> None:
        root = self.root
        if root.lock_ref != 1 or len(root.key) or root.parent is not None:
            raise IntegrityError("the root must be empty, parentless and hold lock_ref 1")

    def _checked_nodes(self) -> Iterator[tuple[TreeNode, str]]:
        """Every node below the root, parents first, with its name for messages, once its
        links, its whole-page key and its lock count (never above its parent's) are checked."""
        root, ps = self.root, self.page_size
        stack = [root]
        while stack:
            parent = stack.pop()
            for page_key, node in parent.children.items():
                where, key_len = f"node {node.node_id}", len(node.key)
                if node.parent is not parent or self._edge_key(node) != page_key:
                    raise IntegrityError(f"{where}: wrong parent link or child key")
                if parent is not root and node.namespace != parent.namespace:
                    raise IntegrityError(f"{where}: in another cache namespace than its parent")
                if not key_len or key_len % ps:
                    raise IntegrityError(f"{where}: key length {key_len}")
                if node.lock_ref < 0 or (parent is not root and node.lock_ref > parent.lock_ref):
                    raise IntegrityError(
                        f"{where}: lock_ref {node.lock_ref}, parent's {parent.lock_ref}"
                    )
                yield node, where
                stack.append(node)

    def _count_device_node(self, node: TreeNode, where: str, num_tokens: dict) -> None:
        """Check a node's device slots are whole page runs, and count them as locked or not."""
        try:
            self._check_page_runs(node.value, where)
        except InvalidArgumentError as exc:
            raise IntegrityError(str(exc)) from exc
        num_tokens[node.lock_ref > 0] += len(node.key)

    def _check_counters(self, num_tokens: dict) -> None:
        counters = (self._num_evictable_tokens, self._num_protected_tokens)
        if counters != (num_tokens[False], num_tokens[True]):
            raise IntegrityError(
                f"(evictable, protected) counters say {counters}, the tree holds"
                f" {(num_tokens[False], num_tokens[True])}"
            )
        per_namespace: Counter[str] = Counter()
        for node in self.iter_nodes():
            if node.namespace and node.value.size:
                per_namespace[node.namespace] += len(node.key)
        if dict(per_namespace) != self._ns_tokens:
            raise IntegrityError("per-namespace device token counters disagree with the tree")

    def _check_namespace_heaps(self) -> None:
        """With a namespace cap: each namespace's device leaves are in its own heap."""
        if not self.namespace_cap:
            return
        recorded = {id(n) for heap in self._ns_leaves.values() for n in heap.candidates()}
        for node in self.iter_nodes():
            if node.namespace and self._is_device_candidate(node) and id(node) not in recorded:
                raise IntegrityError(f"node {node.node_id}: not in its namespace's eviction heap")

    def _check_heap(
        self, heap: EvictionHeap, is_candidate: Callable[[TreeNode], bool], what: str
    ) -> None:
        """Every candidate of a tier is in its eviction heap at its current rank."""
        recorded = {id(n) for n in heap.candidates()}
        for node in self.iter_nodes():
            if is_candidate(node) and id(node) not in recorded:
                raise IntegrityError(f"node {node.node_id}: one of the {what}, not in its heap")
