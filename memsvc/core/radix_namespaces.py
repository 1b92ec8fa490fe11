"""Each cache namespace's share of the radix tree: counted, flushed and capped.

:class:`NamespaceCounts` is a mixin of :class:`~memsvc.core.radix_cache.RadixCache`
(whose module docstring says how the tree keeps namespaces apart). The device
tokens of each non-default namespace are counted as nodes come and go
(:meth:`~NamespaceCounts.namespace_tokens`: no walk). With a cap
(:meth:`~NamespaceCounts.set_namespace_cap`, memsvc's ``--max-cached-tokens-per-salt``)
a namespace over it after an insert evicts its own least recently used unlocked
leaves, never another namespace's, popped from an eviction heap of its own
(:mod:`memsvc.core.evict_heap`) that every change to one of its nodes pushes to.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.evict_heap import EvictionHeap, lru_rank
from memsvc.namespace import DEFAULT_NAMESPACE, is_namespace

if TYPE_CHECKING:
    from memsvc.core.radix_cache import TreeNode


def check_namespace(namespace: object) -> str:
    """``namespace`` if it is one (``""`` or 32 lowercase hex digits), else raise."""
    if namespace != DEFAULT_NAMESPACE and not is_namespace(namespace):
        raise InvalidArgumentError(
            f"bad cache namespace {namespace!r}: '' or 32 lowercase hex digits"
        )
    return namespace  # type: ignore[return-value]


class NamespaceCounts:
    """Per-namespace counters, flush and cap, over what :class:`RadixCache` defines."""

    root: TreeNode

    if TYPE_CHECKING:

        def total_size(self) -> int: ...
        def iter_nodes(self) -> Iterator[TreeNode]: ...
        def _is_free_leaf(self, node: TreeNode) -> bool: ...
        def _evict_from(self, heap: EvictionHeap, num_tokens: int) -> int: ...

    def _init_namespaces(self) -> None:
        # Device tokens per non-default namespace (none listed at 0), and the cap.
        self._ns_tokens: dict[str, int] = {}
        self.namespace_cap = 0
        self._ns_leaves: dict[str, EvictionHeap] = {}  # with a cap: each namespace's leaves

    def namespace_tokens(self) -> dict[str, int]:
        """Device tokens per namespace that holds any (the default one included). Changes
        nothing; costs a dict copy, never a walk."""
        out = dict(self._ns_tokens)
        default = self.total_size() - sum(out.values())
        if default:
            out[DEFAULT_NAMESPACE] = default
        return out

    def set_namespace_cap(self, max_tokens: int) -> None:
        """Cap every non-default namespace's device tokens at ``max_tokens`` (0: no cap),
        enforced after each insert; applies from now on."""
        if max_tokens < 0:
            raise InvalidArgumentError(f"namespace cap must be >= 0, got {max_tokens}")
        self.namespace_cap = max_tokens
        self._ns_leaves = {}
        if max_tokens:
            for node in self.iter_nodes():
                if node.namespace:
                    self._push_namespace_leaf(node)

    def evict_namespace(self, namespace: str, num_tokens: int) -> int:
        """:meth:`evict` of ``namespace``'s unlocked leaves alone, LRU first."""
        if num_tokens < 0:
            raise InvalidArgumentError(f"cannot evict {num_tokens} tokens")
        heap = self._ns_leaves.get(namespace) if namespace and self.namespace_cap else None
        if heap is None:  # no cap heap (or the default namespace): one from its nodes
            heap = EvictionHeap(lru_rank, self._is_device_candidate)
            for node in self.namespace_nodes(namespace):
                heap.push(node)
        return self._evict_from(heap, num_tokens) if num_tokens else 0

    def namespace_nodes(self, namespace: str) -> Iterator[TreeNode]:
        """Every node of ``namespace``, parents first. Changes nothing."""
        stack = [n for n in self.root.children.values() if n.namespace == namespace]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _count_namespace(self, namespace: str, delta: int) -> None:
        """A non-default namespace's device tokens changed by ``delta``."""
        count = self._ns_tokens.get(namespace, 0) + delta
        if count:
            self._ns_tokens[namespace] = count
        else:  # nothing of it on the device: no leaf of it to evict either
            del self._ns_tokens[namespace]
            self._ns_leaves.pop(namespace, None)

    def _push_namespace_leaf(self, node: TreeNode) -> None:
        """With a cap: record a device leaf in its namespace's heap (made on its first)."""
        heap = self._ns_leaves.get(node.namespace)
        if heap is None:
            if not self._is_device_candidate(node):
                return
            heap = EvictionHeap(lru_rank, self._is_device_candidate)
            self._ns_leaves[node.namespace] = heap
        heap.push(node)

    def _is_device_candidate(self, node: TreeNode) -> bool:
        """What :meth:`evict` may take (a subclass's device leaves)."""
        return self._is_free_leaf(node)

    def _enforce_cap(self, namespace: str) -> None:
        """``namespace`` over the cap evicts its own LRU unlocked leaves down to it."""
        cap = self.namespace_cap
        if cap and namespace:
            over = self._ns_tokens.get(namespace, 0) - cap
            if over > 0:
                self.evict_namespace(namespace, over)
