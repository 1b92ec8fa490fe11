"""The hierarchical prefix cache against radix-only, over a matrix of workloads and pools.

Each cell of the matrix is one workload (``bench/hicache_workload.py``: ``docs``,
long shared documents; ``chat``, multi-turn chat with short turns; ``agent``,
agentic traces with long growing contexts; ``unique``, the no-reuse control) on
one device pool size, given as its pressure: the workload's working set (the
distinct tokens of every conversation's final history in a round) over the
pool, from roomy (0.8: the pool holds the whole working set) to tight (4, 6 for
``docs``: a quarter, a sixth of it; never less than the longest history needs).

A cell starts two real normal-mode stacks (memsvc, model_svc, scheduler_svc) on
SmolLM2-135M-Instruct (``--model-path``) with the same pool and scheduler flags,
one with ``--enable-hierarchical-cache`` (memsvc's own defaults, write policy
included, unless ``--write-policy`` names one; ``--storage-dir`` adds the file
disk tier), one radix-only; ``--stacks`` adds ``radix_ref``, radix-only on a pool
twice the working set, and ``radix_b``, a second radix-only stack like ``radix``
(the cell's ``control_*`` figures: what two identical stacks differ by, the
machine's noise in that cell). After an untimed warm-up request and
``--warmup-rounds`` untimed rounds each (1: the first stack to serve a cell's
first round paid for the freshly started processes, 4-6 s more than the
others; always the hierarchy, first in the order), every stack serves
``--rounds`` rounds of fresh conversations (the same ones on every stack), the
stacks' order rotating from round to round so that drift on the machine hits
both; per cell the per-round ratios and their median set one slowed round
aside. A conversation sends its next turn (the whole history, its own replies
token for token, plus the turn's new tokens) as soon as the streamed reply to
the last one is complete; ``in_flight`` conversations run at a time. Replies are
greedy and exactly the workload's output length (``ignore_eos``).

Per cell and stack: TTFT p50 / p99 (submission to the first streamed token),
requests and output tokens per wall second, prompt tokens that hit each tier
(the replies' ``cached_tokens_details``), prefill tokens computed (the
scheduler's stats), each service's CPU seconds (``cpu_s``; the worker's per
round, which the machine's load moves far less than wall time); for the
hierarchy, every counter of memsvc's ``hicache`` stats over the cell (its hit
tokens per tier, loads, backups, and whatever else it counts), the copy
bandwidths; per cell the speedups (radix-only /
hierarchy) and whether the replies were identical token for token.

The last line is JSON: ``cells``, then over the matrix ``worst_ttft_p50_speedup``,
``best_ttft_p50_speedup``, ``worst_throughput_ratio``, ``best_throughput_ratio``,
``all_outputs_identical`` and the ``machine``. Exits non-zero if any replies
differ or a service left shared memory behind. ``--quick``: a tiny matrix on
the tiny model (a smoke test, ``tests/test_bench_hicache.py``). Run with the
repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache_figures import (  # bench/, on the path as the script's folder
    copy_figures,
    machine,
    measure_memcpy,
    table,
)
from hicache_serve import serve
from hicache_workload import KINDS, QUICK, Encoder, Workload, sized

from kvstack.model.paths import resolve_model_path
from kvstack.stack.launch import Launcher
from memsvc.client import MemClient

PAGE_SIZE = 16
MAX_RUNNING_REQUESTS = 64
STACKS = ("hicache", "radix", "radix_ref", "radix_b")

# -- stacks -------------------------------------------------------------------------------


def pool_args(num_pages: int, max_context_len: int) -> list[str]:
    return [
        "--page-size", str(PAGE_SIZE),
        "--num-pages", str(num_pages),
        "--max-running-requests", str(MAX_RUNNING_REQUESTS),
        "--max-context-len", str(max_context_len),
    ]  # fmt: skip


def cell_pool(workload: Workload, pressure: float) -> tuple[int, int]:
    """(device pool pages, max context length) of the workload's cell at ``pressure``."""
    working_set, longest = workload.working_set()
    # At least the longest turn (history and reply) must fit the device pool, with the
    # scheduler's page of headroom.
    num_pages = max(int(working_set / pressure) // PAGE_SIZE, -(-longest // PAGE_SIZE) + 2)
    return num_pages, -(-(longest + 64) // 256) * 256


def hicache_args(args: argparse.Namespace, tmp: str) -> list[str]:
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)]
    if args.write_policy is not None:  # else memsvc's default, whatever it is
        flags += ["--hicache-write-policy", args.write_policy]
    if args.storage_dir is not None:
        directory = args.storage_dir or str(Path(tmp) / "hicache-disk")
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-dir", directory]
    return flags


def hicache_stats(address: str) -> dict[str, Any]:
    with MemClient(address, name="bench") as client:
        return client.stats().get("hicache") or {}


def run_cell(
    checkpoint: Path, workload: Workload, pressure: float, args: argparse.Namespace
) -> tuple[dict[str, Any], list[str]]:
    """One cell: its stacks started, the rounds served, the pools checked; (figures, leaks)."""
    working_set, longest = workload.working_set()
    num_pages, max_context_len = cell_pool(workload, pressure)
    scheduler = [
        "--schedule-conservativeness", str(args.schedule_conservativeness),
        "--retract-mode", args.retract_mode,
    ]  # fmt: skip
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="bench-hicache-") as tmp,
        Launcher(tmp, stop_timeout=10) as launcher,
    ):
        stacks = {}
        for name in args.stacks:
            pages = num_pages if name != "radix_ref" else -(-2 * working_set // PAGE_SIZE)
            pool = pool_args(pages, max_context_len)
            if name == "hicache":
                pool += hicache_args(args, tmp)
            stacks[name] = launcher.start_normal_stack(
                checkpoint, pool, scheduler, suffix=f"-{name}", log_level="WARNING"
            )
        with MemClient(next(iter(stacks.values()))[0].address, name="bench") as client:
            bytes_per_token = client.layout.bytes_per_token
        hc_before = hicache_stats(stacks["hicache"][0].address) if "hicache" in stacks else {}
        services = ("memsvc", "model_svc", "scheduler_svc")
        pids = {
            n: {service: s.proc.pid for service, s in zip(services, stack, strict=True)}
            for n, stack in stacks.items()
        }
        served = asyncio.run(
            serve(
                {n: s[2].address for n, s in stacks.items()},
                workload,
                args.rounds,
                pids,
                warmup_rounds=args.warmup_rounds,
            )
        )
        if "hicache" in stacks:
            hc_after = hicache_stats(stacks["hicache"][0].address)
            served["hicache"]["memsvc"] = copy_figures(hc_before, hc_after, bytes_per_token)
        for mem, _, _ in stacks.values():
            with MemClient(mem.address, name="bench") as client:
                client.check(idle=True)
        launcher.stop_all()
        leaked = list(launcher.leaked_segments)
    cell: dict[str, Any] = {
        "workload": workload.spec.kind,
        "pressure": pressure,
        "working_set_tokens": working_set,
        "longest_history_tokens": longest,
        "device_pool_tokens": num_pages * PAGE_SIZE,
        "working_set_over_pool": round(working_set / (num_pages * PAGE_SIZE), 2),
        **served,
    }
    cell.update(speedups(served))
    cell["cell_s"] = round(time.monotonic() - started, 1)
    return cell, leaked


def speedups(served: dict[str, Any]) -> dict[str, float]:
    """The hierarchy's figures over radix-only's; with ``radix_b``, the same two figures
    between the two identical radix-only stacks (``control_*``: the cell's noise)."""
    out = {}
    radix = served.get("radix")
    if radix is None:
        return out
    if "hicache" in served:
        hi = served["hicache"]
        out["ttft_p50_speedup"] = round(radix["ttft_p50_s"] / hi["ttft_p50_s"], 3)
        out["ttft_p99_speedup"] = round(radix["ttft_p99_s"] / hi["ttft_p99_s"], 3)
        out["throughput_ratio"] = round(hi["requests_per_s"] / radix["requests_per_s"], 3)
        out.update(paired(radix, hi, ""))
    if "radix_b" in served:
        twin = served["radix_b"]
        out["control_ttft_p50_speedup"] = round(radix["ttft_p50_s"] / twin["ttft_p50_s"], 3)
        out["control_throughput_ratio"] = round(twin["requests_per_s"] / radix["requests_per_s"], 3)
        out.update(paired(radix, twin, "control_"))
    return out


def paired(radix: dict[str, Any], other: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The same two figures round by round (each round's chats are the same on both
    stacks, served back to back), and their median over the rounds: one round that the
    machine slowed on one stack moves the pooled figures but not, from 3 rounds up, the
    median."""

    def ratios(key: str) -> list[float]:
        return [r / o for r, o in zip(radix[key], other[key], strict=True) if r > 0 and o > 0]

    ttft, throughput = ratios("round_ttft_p50_s"), ratios("round_wall_s")
    if not ttft or not throughput:
        return {}
    return {
        f"{prefix}round_ttft_p50_speedups": [round(v, 3) for v in ttft],
        f"{prefix}round_throughput_ratios": [round(v, 3) for v in throughput],
        f"{prefix}median_round_ttft_p50_speedup": round(statistics.median(ttft), 3),
        f"{prefix}median_round_throughput_ratio": round(statistics.median(throughput), 3),
    }


# -- the matrix ---------------------------------------------------------------------------


def matrix(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(workload, pressure) of every cell, in run order."""
    kinds = QUICK if args.quick else KINDS
    return [
        (kind, pressure)
        for kind in args.workloads
        for pressure in (args.pressures or kinds[kind].pressures)
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = resolve_model_path(args.model_path)
    encode = Encoder(checkpoint)
    kinds = QUICK if args.quick else KINDS
    overrides = {
        "conversations": args.conversations,
        "turns": args.turns,
        "system_len": args.system_len,
        "turn_len": args.turn_len,
        "output_len": args.output_len,
        "in_flight": args.in_flight,
    }
    workloads = {k: Workload(encode, sized(kinds[k], **overrides), args.seed) for k in kinds}
    host = machine()
    memcpy_gb_s = measure_memcpy(64 << 20)
    cells, leaked = [], []
    for kind, pressure in matrix(args):
        print(f"cell {kind} x{pressure}", file=sys.stderr, flush=True)
        cell, leaks = run_cell(checkpoint, workloads[kind], pressure, args)
        cells.append(cell)
        leaked += leaks
        print(
            f"  ttft_p50_speedup {cell.get('ttft_p50_speedup')} throughput_ratio "
            f"{cell.get('throughput_ratio')} (median round "
            f"{cell.get('median_round_ttft_p50_speedup')} / "
            f"{cell.get('median_round_throughput_ratio')}) identical {cell['outputs_identical']} "
            f"({cell['cell_s']}s)",
            file=sys.stderr,
            flush=True,
        )
    # Measured before and after the stacks ran (the best of both): the machine's ceiling.
    memcpy_gb_s = max(memcpy_gb_s, measure_memcpy(64 << 20))
    for cell in cells:
        copies = cell.get("hicache", {}).get("memsvc", {})
        for kind in ("load", "write"):
            gb_s = copies.get(f"{kind}_gb_per_s")
            if copies:
                copies[f"{kind}_vs_memcpy"] = round(gb_s / memcpy_gb_s, 3) if gb_s else None
    out: dict[str, Any] = {
        "model": str(checkpoint),
        "seed": args.seed,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup_rounds,
        "stacks": args.stacks,
        "hicache_ratio": args.hicache_ratio,
        "write_policy": args.write_policy or "memsvc default",
        "disk_tier": args.storage_dir is not None,
        "retract_mode": args.retract_mode,
        "page_size": PAGE_SIZE,
        "workloads": {k: workloads[k].describe() for k in args.workloads},
        "cells": cells,
    }
    for key in (
        "ttft_p50_speedup",
        "throughput_ratio",
        "median_round_ttft_p50_speedup",
        "median_round_throughput_ratio",
    ):
        values = [c[key] for c in cells if key in c]
        out[f"worst_{key}"] = min(values) if values else None
        out[f"best_{key}"] = max(values) if values else None
    out["all_outputs_identical"] = all(c["outputs_identical"] for c in cells)
    out["machine"] = {**host, "loadavg_end": list(machine()["loadavg"])}
    out["memcpy_gb_per_s"] = round(memcpy_gb_s, 3)
    out["leaked_segments"] = leaked
    return out


def csv(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default=None, help="checkpoint folder, or smollm2 / tiny (default "
        "smollm2; tiny with --quick)"
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a tiny matrix (smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workloads", type=csv(str), default=list(KINDS), help=f"some of {','.join(KINDS)}"
    )
    parser.add_argument(
        "--pressures",
        type=csv(float),
        default=None,
        help="working set / device pool, e.g. 0.8,4 (default: each workload's own)",
    )
    sizes = parser.add_argument_group("sizes (default: each workload's own)")
    sizes.add_argument("--conversations", type=int, help="conversations (agents) per round")
    sizes.add_argument("--turns", type=int, help="turns (steps) per conversation")
    sizes.add_argument("--system-len", type=int, help="shared prefix tokens")
    sizes.add_argument("--turn-len", type=int, help="new tokens per turn")
    sizes.add_argument("--output-len", type=int, help="reply tokens per turn")
    sizes.add_argument("--in-flight", type=int, help="conversations served at a time")
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        help="untimed rounds each stack serves first, with chats of their own (default 1, "
        "0 with --quick): the cell's first timed round then follows a round on every "
        "stack, as the later ones do",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds per cell, order rotating (default 3: the per-round median sets one "
        "slowed round aside; 2 with --quick)",
    )
    parser.add_argument("--hicache-ratio", type=float, default=6.0, help="host tier / device pool")
    parser.add_argument(
        "--write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default=None,
        help="memsvc's --hicache-write-policy (default: memsvc's own)",
    )
    parser.add_argument(
        "--storage-dir",
        nargs="?",
        const="",
        default=None,
        help="add the file disk tier (in DIR, or a temporary folder when DIR is left out)",
    )
    parser.add_argument("--schedule-conservativeness", type=float, default=1.0)
    parser.add_argument(
        "--retract-mode",
        choices=["recompute", "offload", "auto"],
        default="recompute",
        help="both stacks' scheduler --retract-mode",
    )
    parser.add_argument(
        "--stacks",
        type=csv(str),
        default=list(STACKS[:2]),
        help="hicache, radix (the two compared), radix_ref (radix-only on a pool twice "
        "the working set) and radix_b (a second radix-only stack like radix: the noise)",
    )
    args = parser.parse_args(argv)
    if not args.stacks or any(s not in STACKS for s in args.stacks):
        parser.error(f"--stacks names some of {STACKS}")
    if not args.workloads or any(w not in KINDS for w in args.workloads):
        parser.error(f"--workloads names some of {tuple(KINDS)}")
    if args.model_path is None:
        args.model_path = "tiny" if args.quick else "smollm2"
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.warmup_rounds is None:
        args.warmup_rounds = 0 if args.quick else 1
    started = time.monotonic()
    result = run(args)
    result["took_s"] = round(time.monotonic() - started, 1)
    if result.get("cells"):
        print(table(result["cells"]), file=sys.stderr)
    print(f"took {result['took_s']}s", file=sys.stderr)
    print(json.dumps(result))
    if result["leaked_segments"] or not result["all_outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
