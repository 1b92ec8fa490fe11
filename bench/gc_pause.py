"""The garbage collector's cost on memsvc's decode step, with and without kvstack's policy.

Issue 28, item 4: :func:`memsvc.gcpolicy.apply_gc_policy` (``gc.freeze()`` after
start-up, higher thresholds) against CPython's defaults. Each run is a fresh
interpreter that does what ``python -m memsvc`` does (import, build the pool,
then, in ``policy`` runs only, apply the policy), then serves a workload
in-process on :class:`memsvc.core.KVPool`:

- a prefix tree grown to ``--tree-nodes`` nodes (page size 1, sequences that
  share seeded random prefixes);
- ``--batch`` running requests; each step is one ``alloc_decode_rows`` of the
  whole batch over a full pool (so it evicts from the tree), then the oldest
  request finishes (its KV inserted into the tree) and a new one is admitted
  (a cached prefix matched, a fresh tail extended): the churn a serving
  memsvc sees.

A step's time is the decode allocation alone (``step``) and with the finish and
the admission (``iteration``). ``gc.callbacks`` count the collections by
generation and time them while the tree grows (``growing``: each node is a
container that survives, the case where the defaults run full collections)
and over the ``--steps`` timed steps (``stepping``; ``full_collections`` counts
gen-2 ones). One full collection (``gc.collect()``) is timed at the end, the
tree and the batch alive: the pause each of them costs. Runs alternate
default / policy ``--rounds`` times in one invocation. The last line is JSON::

    {"default": {...}, "policy": {...}, "ratio_mean_iteration": policy / default, ...}
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MODES = ("default", "policy")


class CollectorWatch:
    """Collections by generation and the time they took, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.longest_ms = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = (time.perf_counter() - self._started) * 1e3
        self.counts[info["generation"]] += 1
        self.ms[info["generation"]] += took
        self.longest_ms = max(self.longest_ms, took)

    def report(self) -> dict[str, Any]:
        return {
            "collections": self.counts,
            "gc_ms": round(sum(self.ms), 3),
            "longest_pause_ms": round(self.longest_ms, 3),
        }


def child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process (started fresh by :func:`main`)."""
    from memsvc.core import KVPool
    from memsvc.core.layout import PoolLayout
    from memsvc.gcpolicy import apply_gc_policy, gc_state

    rng = np.random.default_rng(args.seed)
    # Each running request lives --batch steps (one finishes per step): at most this long.
    max_len = args.prompt + args.batch + 1
    running_tokens = args.batch * max_len
    layout = PoolLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        page_size=1,
        num_pages=running_tokens + args.tree_tokens,
        max_running_requests=args.batch + 1,
        max_context_len=max(max_len, 4 * args.tree_tokens // args.tree_nodes + args.prompt),
    )
    pool = KVPool(layout, host_store_bytes=1 << 20)
    if mode == "policy":
        apply_gc_policy()
    sequences: list[np.ndarray] = []
    next_token = [1]

    def fresh(n: int) -> np.ndarray:
        out = np.arange(next_token[0], next_token[0] + n, dtype=np.int64)
        next_token[0] += n
        return out

    def prompt() -> np.ndarray:
        """A cached prefix cut at random, then fresh tokens up to ``--prompt`` in all."""
        prefix = np.empty(0, dtype=np.int64)
        if sequences:
            base = sequences[int(rng.integers(len(sequences)))]
            prefix = base[: int(rng.integers(0, min(len(base), args.prompt - 1)))]
        return np.concatenate([prefix, fresh(args.prompt - len(prefix))])

    def admit(rid: str, tokens: np.ndarray) -> int:
        row = pool.open_request(rid)
        done = pool.match_prefix(rid, tokens[:-1])
        if pool.alloc_extend([(rid, len(tokens) - done)]) is None:
            raise RuntimeError("the pool is too small for the workload")
        return row

    def finish(rid: str, tokens: np.ndarray) -> None:
        pool.release(rid, tokens, is_insert=True)
        sequences.append(tokens)

    batch: list[tuple[str, list[np.ndarray]]] = []
    rows = np.zeros(args.batch, dtype=np.int64)
    for i in range(args.batch):
        tokens = prompt()
        rows[i] = admit(f"run{i}", tokens)
        batch.append((f"run{i}", [tokens]))
    # The tree: finished requests (a prompt, then a tail of 2 x tree-tokens / tree-nodes
    # tokens on average: about two nodes each, a leaf and a split) until the pool is
    # full (the batch admitted first): from then on each step evicts what it needs.
    count, mean_tail = 0, 2 * args.tree_tokens // args.tree_nodes
    growing = CollectorWatch()
    gc.callbacks.append(growing)
    while pool.available_size() > args.batch:
        tokens = np.concatenate([prompt(), fresh(int(rng.integers(1, 2 * mean_tail)))])
        admit(f"fill{count}", tokens)
        finish(f"fill{count}", tokens)
        count += 1
    gc.callbacks.remove(growing)
    nodes_at_start = sum(1 for _ in pool.tree.iter_nodes())
    stepping = CollectorWatch()

    steps, iterations = [], []
    oldest = 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            gc.callbacks.append(stepping)
        started = time.perf_counter()
        if pool.alloc_decode_rows(rows) is None:
            raise RuntimeError("a decode step did not fit")
        stepped = time.perf_counter()
        for _, chunks in batch:
            chunks.append(fresh(1))
        rid, chunks = batch[oldest]
        finish(rid, np.concatenate(chunks))
        tokens = prompt()
        rows[oldest] = admit(f"new{i}", tokens)
        batch[oldest] = (f"new{i}", [tokens])
        oldest = (oldest + 1) % args.batch
        ended = time.perf_counter()
        if i >= args.warmup:
            steps.append(stepped - started)
            iterations.append(ended - started)
    gc.callbacks.remove(stepping)
    nodes = sum(1 for _ in pool.tree.iter_nodes())
    started = time.perf_counter()
    gc.collect()  # what one full collection costs now, the tree and the batch alive
    full_ms = (time.perf_counter() - started) * 1e3
    pool.check_integrity()
    pool.close()
    return {
        "step_ms": summary(steps),
        "iteration_ms": summary(iterations),
        "full_collections": stepping.counts[2],
        "growing": growing.report(),
        "stepping": stepping.report(),
        "full_collection_ms": round(full_ms, 3),
        "tree_nodes": [nodes_at_start, nodes],
        "gc": gc_state(),
    }


def summary(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {
        "mean": round(float(ms.mean()), 3),
        "p50": round(float(np.percentile(ms, 50)), 3),
        "p99": round(float(np.percentile(ms, 99)), 3),
        "max": round(float(ms.max()), 3),
    }


def run_child(mode: str, argv: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, *argv],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return json.loads(out.stdout.splitlines()[-1])


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over rounds of each figure."""
    out: dict[str, Any] = {}
    for key in ("step_ms", "iteration_ms"):
        out[key] = {k: statistics.median(r[key][k] for r in runs) for k in runs[0][key]}
    out["full_collections"] = [r["full_collections"] for r in runs]
    for phase in ("growing", "stepping"):
        out[phase] = [r[phase] for r in runs]
    out["full_collection_ms"] = statistics.median(r["full_collection_ms"] for r in runs)
    out["tree_nodes"] = [r["tree_nodes"] for r in runs]
    out["gc"] = runs[-1]["gc"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tree-nodes", type=int, default=5000)
    parser.add_argument(
        "--tree-tokens", type=int, default=600_000, help="the tree's share of the pool"
    )
    parser.add_argument("--prompt", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="default/policy alternations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    passed = list(argv if argv is not None else sys.argv[1:])
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_child(mode, passed))
    result: dict[str, Any] = {mode: combine(runs[mode]) for mode in MODES}
    for key in ("step_ms", "iteration_ms"):
        d, q = result["default"][key]["mean"], result["policy"][key]["mean"]
        result[f"ratio_mean_{key[:-3]}"] = round(q / d, 3)
    result["config"] = {
        k: getattr(args, k) for k in ("batch", "tree_nodes", "tree_tokens", "prompt", "steps")
    }
    for mode in MODES:
        r = result[mode]
        print(
            f"{mode:>8}: step mean {r['step_ms']['mean']:.3f} ms p99 {r['step_ms']['p99']:.3f}; "
            f"iteration mean {r['iteration_ms']['mean']:.3f} ms p99 "
            f"{r['iteration_ms']['p99']:.3f}; full collections {r['full_collections']}, "
            f"one takes {r['full_collection_ms']:.2f} ms; growing the tree: "
            f"{r['growing'][0]['collections']} collections, {r['growing'][0]['gc_ms']} ms, "
            f"longest {r['growing'][0]['longest_pause_ms']} ms",
            file=sys.stderr,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
