"""One tier's eviction candidates, kept between calls so that eviction never walks the tree.

A lazy-deletion min-heap of ``(rank, node_id, node)``: ``rank`` is what the
tier orders by (SGLang's LRU: the node's ``last_access_time``, with tiers that
put some nodes last prefixing a flag), ``node_id`` breaks ties by creation
order. The tree calls :meth:`EvictionHeap.push` whenever a node may have
become a candidate or changed rank (insert, split, access, unlock, a child
gone, a copy added or dropped); nothing is removed when a node stops being
one (locked, given a child, touched again, evicted). The invariant::

    every candidate has an entry with its current rank; other entries are stale

so the first entry that is still current when popped is the candidate an
eviction that built a fresh heap of every candidate would pop: the order is
the full walk's, at O(log n) a pop. Stale entries are dropped when they
surface, and all at once (:meth:`_compact`) when they outnumber the rest.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memsvc.core.radix_cache import TreeNode

_MIN_COMPACT = 1024


def lru_rank(node: TreeNode) -> int:
    """SGLang's LRU: least recently used first (the entry's ``node_id`` breaks ties)."""
    return node.last_access_time


class EvictionHeap:
    """Candidates of one tier, least ``rank`` first (see the module docstring)."""

    __slots__ = ("_compact_at", "_heap", "_is_candidate", "_rank")

    def __init__(
        self, rank: Callable[[TreeNode], Any], is_candidate: Callable[[TreeNode], bool]
    ) -> None:
        self._rank = rank
        self._is_candidate = is_candidate
        self._heap: list[tuple[Any, int, TreeNode]] = []
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        """Entries, stale ones included."""
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """Record ``node`` at its current rank if it is a candidate now."""
        if self._is_candidate(node):
            heapq.heappush(self._heap, (self._rank(node), node.node_id, node))
            if len(self._heap) > self._compact_at:
                self._compact()

    def pop(self) -> TreeNode | None:
        """Take the least-ranked candidate out (``None``: there is none).

        The caller evicts it, or pushes it back when it keeps it.
        """
        heap, rank_of, is_candidate = self._heap, self._rank, self._is_candidate
        while heap:
            rank, _, node = heapq.heappop(heap)
            if rank == rank_of(node) and is_candidate(node):
                return node
        return None

    def candidates(self) -> Iterator[TreeNode]:
        """The nodes with a current entry (for the integrity check). Changes nothing."""
        for rank, _, node in self._heap:
            if self._is_current(rank, node):
                yield node

    def _is_current(self, rank: Any, node: TreeNode) -> bool:
        return rank == self._rank(node) and self._is_candidate(node)

    def _compact(self) -> None:
        """Drop every stale entry and repeats (amortized: runs after as many pushes)."""
        current = {id(e[2]): e for e in self._heap if self._is_current(e[0], e[2])}
        self._heap = list(current.values())
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))
