"""The control plane at serving scale (issue 28, item 6): what memsvc and the scheduler cost.

Sections, each one function in :data:`SECTIONS` that returns its table and
its figures (``--sections`` picks some; all by default; ``--quick`` makes every
one small, for a smoke test); the last line printed is one JSON object holding
every section's figures and the machine's name. Every comparison's baseline is
measured in the same run, interleaved with it.

``evict`` (here): in-process, GC off, ``RadixCache.evict`` of 256 tokens from a
tree of 5k / 20k / 100k nodes, at page size 1 and 16, against the full-walk
eviction it replaced (issue 28, item 1: every call built a heap of every free
leaf by walking the whole tree), measured in the same run on the same tree,
calls interleaved (so each finds the caches cold from the other's walk). The
tree (seeded, :class:`~control_plane_mem.Sequences`): each insert is a cached
sequence cut at a random page (at most 32 pages in) plus 1 to
``--max-tail-tokens`` tokens of fresh ones (whole pages, at least 1 and 4 of
them), so most inserts split a node and add a leaf: at the default 40, page
size 1 holds ~10 tokens a node, the 1M-token pool of the issue at 100k nodes;
4 makes leaves of 1-4 tokens, the most leaves per 256 tokens. After every timed
eviction fresh sequences refill what was evicted, so the tree stays at its
size. Figures are medians over ``--repeats`` calls;
``evict_256_tokens_100k_nodes_ms`` is the slower page size's.

``decode`` and ``retract`` (:mod:`control_plane_steps`): memsvc's
``decode_step`` with a free and a full pool, and a retract of 32 of 256, each
as a round trip to the memsvc process (async and sync client), in memsvc's
in-process handler and as a bare ZMQ echo of the same frames.

``admission`` and ``overlap`` (:mod:`control_plane_engine`): the engine's
memsvc round trips to admit 64 prompts, and the share of decode step wall time
not covered by the tiny model's forward pass, overlap schedule on and off.

Run as a script, the process first applies :func:`memsvc.gcpolicy.apply_gc_policy`,
as memsvc and the scheduler do once started, so that what runs in process here
(memsvc's handler, the engine) collects garbage as it does in the services.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from control_plane_engine import bench_admission, bench_overlap  # bench/, on the path
from control_plane_mem import TreeGrower
from control_plane_steps import BATCHES, bench_decode, bench_retract

from memsvc.core.allocator import PageAllocator
from memsvc.core.radix_cache import RadixCache
from memsvc.gcpolicy import apply_gc_policy

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
    rows = [evict_case(ps, n, args) for ps in args.page_sizes for n in args.tree_sizes]
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

Section = Callable[[argparse.Namespace], tuple[list[str], dict[str, Any]]]
SECTIONS: dict[str, Section] = {
    "evict": bench_evict,
    "decode": bench_decode,
    "retract": bench_retract,
    "admission": bench_admission,
    "overlap": bench_overlap,
}
# --quick: every section small, for a smoke test (flags given explicitly still win).
QUICK = {
    "tree_sizes": [300, 1000],
    "repeats": 3,
    "batches": [1, 16],
    "rounds": 2,
    "steps": 3,
    "pool_tokens": 200_000,
    "retract_repeats": 3,
    "admission_prompt_tokens": 128,
    "admission_repeats": 1,
    "overlap_batches": [4],
    "overlap_steps": 3,
    "overlap_rounds": 1,
}


def machine() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), cores, platform."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="every section small (smoke test)")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=list(TREE_SIZES))
    parser.add_argument("--seed", type=int, default=0)
    evict = parser.add_argument_group("evict")
    evict.add_argument("--repeats", type=int, default=15)
    evict.add_argument("--max-tail-tokens", type=int, default=40)
    decode = parser.add_argument_group("decode and retract")
    decode.add_argument("--pool-tokens", type=int, default=1_000_000)
    decode.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    decode.add_argument("--rounds", type=int, default=5, help="interleaved rounds per figure")
    decode.add_argument("--steps", type=int, default=8, help="decode steps per round and method")
    decode.add_argument("--decode-tail-tokens", type=int, default=8)
    decode.add_argument("--retract-repeats", type=int, default=20)
    engine = parser.add_argument_group("admission and overlap")
    engine.add_argument("--admission-prompt-tokens", type=int, default=2048)
    engine.add_argument("--admission-repeats", type=int, default=5)
    engine.add_argument("--overlap-batches", type=int, nargs="+", default=[16, 256])
    engine.add_argument("--overlap-steps", type=int, default=10, help="decode steps per block")
    engine.add_argument("--overlap-rounds", type=int, default=4, help="on/off block pairs")
    if argv is None:
        argv = sys.argv[1:]
    if "--quick" in argv:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result: dict[str, Any] = {"machine": machine(), "python": platform.python_version()}
    for name in args.sections:
        started = time.monotonic()
        lines, figures = SECTIONS[name](args)
        print("\n".join(lines), flush=True)
        print(f"({name}: {time.monotonic() - started:.0f} s)\n", flush=True)
        result.update(figures)
    print(json.dumps(result))


if __name__ == "__main__":
    apply_gc_policy()  # memsvc's and the scheduler's: the in-process sides run as they do
    main()
