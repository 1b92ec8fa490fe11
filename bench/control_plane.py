"""The control plane at serving scale (issue 28, item 6): what memsvc's own work costs.

Sections, each one function in :data:`SECTIONS` that returns its table and
its figures (``--sections`` picks some; all by default); the last line printed
is one JSON object holding every section's figures and the machine's name.

``evict``: in-process, GC off, ``RadixCache.evict`` of 256 tokens from a tree
of 5k / 20k / 100k nodes, at page size 1 and 16, against the full-walk
eviction it replaced (issue 28, item 1: every call built a heap of every free
leaf by walking the whole tree), measured in the same run on the same tree,
calls interleaved (so each finds the caches cold from the other's walk). The
tree (seeded): each insert is a cached sequence cut at a random page (at most
32 pages in) plus 1 to ``--max-tail-tokens`` tokens of fresh ones (whole pages,
at least 1 and 4 of them), so most inserts split a node and add a leaf: at the
default 40, page size 1 holds ~10 tokens a node, the 1M-token pool of the
issue at 100k nodes; 4 makes leaves of 1-4 tokens, the most leaves per 256
tokens. After every timed eviction fresh sequences refill what was evicted, so
the tree stays at its size. Figures are medians over ``--repeats`` calls;
``evict_256_tokens_100k_nodes_ms`` is the slower page size's.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from memsvc.core.allocator import PageAllocator
from memsvc.core.radix_cache import RadixCache

EVICT_TOKENS = 256
TREE_SIZES = (5_000, 20_000, 100_000)
PAGE_SIZES = (1, 16)


# -- evict --------------------------------------------------------------------------


def full_walk_evict(cache: RadixCache, num_tokens: int) -> int:
    """The eviction before issue 28: a heap of every free leaf, built by a full walk.

    It also records the parents it leaves as leaves in the cache's own heap
    (``_touch``: one push each) so that the tree, shared with the timed new
    eviction, stays consistent; the old code had no such push.
    """
    heap = [
        (n.last_access_time, n.node_id, n) for n in cache.iter_nodes() if cache._is_free_leaf(n)
    ]
    heapq.heapify(heap)
    num_evicted, freed = 0, []
    while num_evicted < num_tokens and heap:
        _, _, leaf = heapq.heappop(heap)
        parent = leaf.parent
        del parent.children[cache._page_key(leaf.key)]
        leaf.parent = None
        freed.append(leaf.value)
        num_evicted += len(leaf.key)
        if cache._is_free_leaf(parent):
            heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
            cache._touch(parent)
    cache._num_evictable_tokens -= num_evicted
    if freed:
        cache.allocator.free(np.concatenate(freed))
    return num_evicted


class TreeGrower:
    """Inserts seeded sequences that share prefixes (see the module docstring)."""

    def __init__(self, cache: RadixCache, seed: int, max_tail_pages: int) -> None:
        self.cache = cache
        self.max_tail_pages = max_tail_pages
        self.rng = np.random.default_rng(seed)
        self.sequences: list[np.ndarray] = []
        self.next_token = 1

    def insert_one(self) -> int:
        """Insert one sequence; returns the tokens the tree took."""
        ps, rng = self.cache.page_size, self.rng
        prefix = np.empty(0, dtype=np.int64)
        if self.sequences:
            base = self.sequences[int(rng.integers(len(self.sequences)))]
            cut = int(rng.integers(0, min(len(base) // ps, 32) + 1)) * ps
            prefix = base[:cut]
        tail_len = int(rng.integers(1, self.max_tail_pages + 1)) * ps
        tail = np.arange(self.next_token, self.next_token + tail_len, dtype=np.int64)
        self.next_token += tail_len
        tokens = np.concatenate([prefix, tail])
        self.sequences.append(tokens)
        slots = self.cache.allocator.alloc(len(tokens))
        prefix_len = self.cache.insert(tokens, slots)
        self.cache.allocator.free(slots[:prefix_len])
        return len(tokens) - prefix_len

    def grow_to(self, num_nodes: int) -> None:
        while self.cache._num_nodes_created - 1 < num_nodes:  # nothing evicted yet
            self.insert_one()

    def refill(self, num_tokens: int) -> None:
        added = 0
        while added < num_tokens:
            added += self.insert_one()


def time_ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def evict_case(page_size: int, num_nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    repeats = args.repeats
    max_tail_pages = max(4, args.max_tail_tokens // page_size)
    # Enough pages for the tree and every refill: a node holds at most one tail of its own.
    num_pages = max_tail_pages * (num_nodes + 2 * EVICT_TOKENS * repeats) + 1024
    cache = RadixCache(PageAllocator(num_pages, page_size))
    grower = TreeGrower(cache, args.seed, max_tail_pages)
    grower.grow_to(num_nodes)
    new_ms, old_ms = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            evicted = 0

            def new() -> None:
                nonlocal evicted
                evicted = cache.evict(EVICT_TOKENS)

            new_ms.append(time_ms(new))
            grower.refill(evicted)

            def old() -> None:
                nonlocal evicted
                evicted = full_walk_evict(cache, EVICT_TOKENS)

            old_ms.append(time_ms(old))
            grower.refill(evicted)
    finally:
        gc.enable()
    cache.check()
    new, old = statistics.median(new_ms), statistics.median(old_ms)
    return {
        "page_size": page_size,
        "nodes": sum(1 for _ in cache.iter_nodes()),
        "tokens": cache.total_size(),
        "heap_ms": round(new, 4),
        "full_walk_ms": round(old, 4),
        "speedup": round(old / new, 1),
    }


def bench_evict(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    rows = [evict_case(ps, n, args) for ps in PAGE_SIZES for n in args.tree_sizes]
    lines = [
        f"evict {EVICT_TOKENS} tokens (in-process, GC off, median of {args.repeats}, "
        f"tails of up to {args.max_tail_tokens} tokens)",
        f"{'page':>5} {'nodes':>8} {'tokens':>9} {'heap ms':>9} {'full walk ms':>13}"
        f" {'speedup':>8}",
    ]
    lines += [
        f"{r['page_size']:>5} {r['nodes']:>8} {r['tokens']:>9} {r['heap_ms']:>9.3f} "
        f"{r['full_walk_ms']:>13.3f} {r['speedup']:>7.1f}x"
        for r in rows
    ]
    figures: dict[str, Any] = {"evict": rows, "evict_max_tail_tokens": args.max_tail_tokens}
    largest = max(args.tree_sizes)
    if largest == 100_000:
        figures["evict_256_tokens_100k_nodes_ms"] = max(
            r["heap_ms"] for r in rows if r["nodes"] >= 0.9 * largest
        )
    return lines, figures


# -- the script -------------------------------------------------------------------------

SECTIONS: dict[str, Callable[[argparse.Namespace], tuple[list[str], dict[str, Any]]]] = {
    "evict": bench_evict,
}


def machine() -> str:
    return f"{platform.machine()} {platform.processor() or platform.node()}, {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=list(TREE_SIZES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-tail-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result: dict[str, Any] = {"machine": machine(), "python": platform.python_version()}
    for name in args.sections:
        lines, figures = SECTIONS[name](args)
        print("\n".join(lines), flush=True)
        result.update(figures)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
