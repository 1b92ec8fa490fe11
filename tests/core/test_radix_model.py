"""RadixCache against a small reference model of SGLang's radix-cache rules.

The model is written from ``reference/sglang-retract-semantics.md`` §6.4 (and
issue 19's note on split stamps), not from either implementation: a flat set
of nodes, each the edge ``path[start:]`` of a cached key ``path``, with

- match: walk from the root by first page; every node visited gets the
  operation's access time (before a split); a match ending inside a node
  splits it at that page boundary into an upper node and the lower rest,
  both just stamped;
- insert: match, then one new leaf for the rest of the page-aligned key;
- locks: a node is locked while a held lock's path runs through it;
- evict: the least recently used unlocked childless node goes, whole, until
  enough tokens went or nothing evictable is left.

After every step the machine compares node structure, access times, sizes,
match lengths and what was evicted, then runs the page integrity check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memsvc.core.radix_cache import TreeNode
from tests.core.test_radix_cache import assert_integrity, make_cache, toks

NUM_PAGES = 24


@dataclass
class ModelNode:
    start: int  # the node holds tokens path[start:] of its full path
    last_access: int


class RadixModel:
    """Nodes keyed by their full path (a tuple of token ids, page-aligned)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.nodes: dict[tuple[int, ...], ModelNode] = {}
        self.locks: list[tuple[int, ...]] = []  # paths of held locks, with repeats
        self.clock = 0

    def _child(self, key: tuple[int, ...], at: int) -> tuple[int, ...] | None:
        page = key[at : at + self.page_size]
        if len(page) < self.page_size:
            return None
        for path, node in self.nodes.items():
            if (
                node.start == at
                and path[:at] == key[:at]
                and path[at : at + self.page_size] == page
            ):
                return path
        return None

    def _common(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n - n % self.page_size

    def match(self, key: tuple[int, ...]) -> int:
        """Matched length; stamps the path, splits the node the match ends inside."""
        self.clock += 1
        matched = 0
        while (path := self._child(key, matched)) is not None:
            node = self.nodes[path]
            node.last_access = self.clock
            end = matched + self._common(path[matched:], key[matched:])
            if end < len(path):  # split: the upper part becomes its own node
                self.nodes[path[:end]] = ModelNode(matched, self.clock)
                node.start = end
                return end
            matched = end
        return matched

    def insert(self, key: tuple[int, ...]) -> int:
        present = self.match(key)
        if present < len(key):
            self.nodes[key] = ModelNode(present, self.clock)
        return present

    def lock_count(self, path: tuple[int, ...]) -> int:
        return sum(1 for locked in self.locks if locked[: len(path)] == path)

    def _has_child(self, path: tuple[int, ...]) -> bool:
        end = len(path)
        return any(n.start == end and p[:end] == path for p, n in self.nodes.items())

    def evict(self, num_tokens: int) -> int:
        evicted = 0
        while evicted < num_tokens:
            free = [
                path
                for path in self.nodes
                if not self._has_child(path) and self.lock_count(path) == 0
            ]
            if not free:
                break
            victim = min(free, key=lambda path: self.nodes[path].last_access)
            evicted += len(victim) - self.nodes.pop(victim).start
        return evicted

    def sizes(self) -> tuple[int, int]:
        """(evictable, protected) tokens."""
        sizes = [0, 0]
        for path, node in self.nodes.items():
            sizes[self.lock_count(path) > 0] += len(path) - node.start
        return sizes[0], sizes[1]


def full_path(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(int(t) for t in np.concatenate(parts[::-1])) if parts else ()


class RadixMachine(RuleBasedStateMachine):
    page_size = 1

    @initialize()
    def setup(self) -> None:
        self.cache = make_cache(self.page_size, num_pages=NUM_PAGES)
        self.model = RadixModel(self.page_size)
        self.locked: list[TreeNode] = []

    def teardown(self) -> None:
        for node in self.locked:
            self.cache.unlock(node)
        self.cache.evict(self.cache.allocator.capacity)
        assert_integrity(self.cache, idle=True)

    def _key(self, page_kinds: list[int]) -> np.ndarray:
        return toks(self.page_size, page_kinds)

    keys = st.lists(st.integers(0, 2), max_size=5)  # one kind per page

    @rule(key=keys)
    def insert(self, key) -> None:
        tokens = self._key(key)
        slots = self.cache.allocator.alloc(len(tokens))
        if slots is None:
            return
        present = self.cache.insert(tokens, slots)
        assert present == self.model.insert(tuple(tokens.tolist()))
        self.cache.allocator.free(slots[:present])  # the caller's duplicates

    @rule(key=keys, lock=st.booleans())
    def match(self, key, lock: bool) -> None:
        tokens = self._key(key)
        match = self.cache.match_prefix(tokens)
        matched = self.model.match(tuple(tokens.tolist()))
        assert len(match.slots) == matched
        if lock:
            self.cache.lock(match.last_node)
            self.locked.append(match.last_node)
            self.model.locks.append(tuple(tokens[:matched].tolist()))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        i = data.draw(st.integers(0, len(self.locked) - 1))
        self.cache.unlock(self.locked.pop(i))
        self.model.locks.pop(i)

    @rule(num_tokens=st.integers(1, 10))
    def evict(self, num_tokens: int) -> None:
        num_tokens *= self.page_size
        assert self.cache.evict(num_tokens) == self.model.evict(num_tokens)

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        nodes = {
            full_path(n): (len(full_path(n)) - len(n.key), n.last_access_time)
            for n in self.cache.iter_nodes()
        }
        model = {p: (n.start, n.last_access) for p, n in self.model.nodes.items()}
        assert nodes == model
        sizes = (self.cache.evictable_size(), self.cache.protected_size())
        assert sizes == self.model.sizes()
        assert_integrity(self.cache)


MODEL_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None, derandomize=True)


class RadixMachinePage1(RadixMachine):
    page_size = 1


class RadixMachinePage4(RadixMachine):
    page_size = 4


TestRadixModelPage1 = RadixMachinePage1.TestCase
TestRadixModelPage1.settings = MODEL_SETTINGS
TestRadixModelPage4 = RadixMachinePage4.TestCase
TestRadixModelPage4.settings = MODEL_SETTINGS
