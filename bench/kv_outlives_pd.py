"""KV outlives its users (issue 32), measured on PD stacks: bench/kv_outlives.py's
``move`` and ``skew`` parts.

The move part (``--parts move``): a PD stack whose decode node has a peer
(``--migrate-to``); one ``--migrate-len``-token request (4,096) streams, then
streams again with the decode node drained (SIGTERM) mid-decode, so that it
moves to the peer with its KV: ``migration_bytes``, ``migration_s`` (its
stream's stall: the park, the send, the peer's preallocation and first step),
``migration_vs_reprefill`` (that over one prefill of its prompt on the prefill
node); then a node holding ``--drain-requests`` requests (16) drained the same
way: ``drain_moved_reqs``, ``drain_moves_followed`` (those the router
re-submitted to the peer, streaming from there), ``drain_s`` (until it
stopped: once the last request moved, not once it ended), the tokens prefilled
again (``*_reprefilled_tokens``) and token identity with the untouched run.

The skew part (``--parts skew``): ``--skew-requests`` greedy requests (24) of
``--skew-prompt-len`` tokens (256), ``--skew-max-new`` new tokens each (96), at
once on a PD stack whose router sends everything to decode node D1 (hot); D2
(cold) has the same pool, each ``--skew-pool`` (0.4) of the batch's final KV,
and a tight decode reserve (16), so that D1 retracts as its requests grow. Run
twice: ``static`` (D1 keeps its retracted requests) and ``rebalanced`` (D1
moves them to D2, ``--migrate-to`` with the default cost policy). Per run:
latency (submission to last token) and TTFT p50 / p99, wall time, retracts,
moves; ``skew_latency_p50_speedup`` / ``_p99_`` (static over rebalanced) and
token identity between the two.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from kv_outlives_run import PAGE_SIZE, Run, next_token_s, quantile_s  # bench/

from kvstack.model.paths import resolve_model_path
from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import GenerateClient

RESERVE = 64  # --num-reserved-decode-tokens of the move and drain runs
SKEW_RESERVE = 16  # ... of the skewed-load runs: a tight reserve, so that D1 retracts


def pd_pool(tokens: int, requests: int) -> list[str]:
    pages = 2 * -(-(tokens + RESERVE * requests) // PAGE_SIZE) + 8
    return [
        "--page-size", str(PAGE_SIZE),
        "--num-pages", str(pages),
        "--max-running-requests", "32",
        "--max-context-len", str(-(-(tokens + PAGE_SIZE) // 1024) * 1024),
    ]  # fmt: skip


def drain_run(
    checkpoint: Path, prompts: list[list[int]], max_new: int, drain_after: int
) -> dict[str, Any]:
    """A PD stack whose decode node D1 has a peer D2 (``--migrate-to``): the prompts
    stream there untouched (the reference), then again with D1 drained (SIGTERM) once
    each has streamed ``drain_after`` tokens: every one moves to D2 with its KV."""
    tokens = max(map(len, prompts)) * len(prompts) + max_new * len(prompts)
    with tempfile.TemporaryDirectory(prefix="kvo-pd-", dir="/tmp") as tmp, Launcher(tmp) as up:
        nodes = up.start_pd_stack(
            checkpoint,
            pd_pool(tokens, len(prompts)),
            # each request's decode reserve (512 by default) is what D2 must have free
            # to take it: kept small, so that the pools need not be sized for it
            ["--worker-timeout", "900", "--num-reserved-decode-tokens", str(RESERVE)],
            migrate_to_pool=[],
            transfer_backend="zmq",
            log_level="WARNING",
        )
        address = nodes["router"].address
        reference = Run(prompts, max_new, "ref")
        started = time.monotonic()
        asyncio.run(reference.serve(address))
        reference_s = time.monotonic() - started
        with GenerateClient(address) as client:  # the moved run prefills its prompts again
            flushed, why = client.flush_cache()
            assert flushed, why
        with GenerateClient(nodes["scheduler-p"].address) as client:
            stats = client.info()["stats"]
            prefill_s, prefilled_before = float(stats["prefill_s"]), int(stats["prefill_tokens"])
        drained: dict[str, float] = {}

        async def drain(run: Run) -> None:
            while min(len(t) for t in run.tokens.values()) < drain_after:
                await asyncio.sleep(0.005)
            drained["at"] = time.monotonic()
            drained["arrivals"] = len(run.arrivals)
            nodes["scheduler-d"].proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(nodes["scheduler-d"].proc.wait, 600)
            drained["stopped"] = time.monotonic()

        moved = Run(prompts, max_new, "moved")
        asyncio.run(moved.serve(address, drain))
        with GenerateClient(nodes["scheduler-d2"].address) as client:
            d2 = client.info()["stats"]
        with GenerateClient(address) as client:  # (D1 is gone: a 503 with its own figures)
            followed = int(client.info()["router"]["moves_followed"])
        with GenerateClient(nodes["scheduler-p"].address) as client:
            prefilled = int(client.info()["stats"]["prefill_tokens"])
        with MemClient(nodes["memsvc-d"].address) as mem:  # what D1 sent (to D2 only)
            moved_bytes = int(mem.stats()["transfer"]["bytes"])
        for name in ("memsvc-d", "memsvc-d2", "memsvc-p"):
            with MemClient(nodes[name].address) as mem:
                mem.check(idle=True)
    return {
        "reference_s": round(reference_s, 2),
        "prefill_s": prefill_s,
        "moved_reqs": int(d2["migrated_in_reqs"]),
        "moves_followed": followed,
        "moved_bytes": moved_bytes,
        "stall_s": next_token_s(moved.arrivals[drained["arrivals"] :], drained["at"]),
        "drain_s": round(drained["stopped"] - drained["at"], 3),
        # beyond one prefill of each prompt: the prefill node's, and D2's (none: it decodes)
        "reprefilled_tokens": prefilled
        - prefilled_before
        - sum(map(len, prompts))
        + int(d2["prefill_tokens"]),
        "outputs_identical": moved.tokens == reference.tokens and not moved.errors,
        "errors": moved.errors,
    }


def measure_moves(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: one ``--migrate-len``-token request moved (its stream's stall against the
    prefill that re-prefilling it would take); part 3: a node holding
    ``--drain-requests`` requests drained."""
    checkpoint = resolve_model_path(args.model_path)
    rng = random.Random(args.seed + 1)
    one = [[rng.randrange(*args.token_range) for _ in range(args.migrate_len)]]
    move = drain_run(checkpoint, one, args.max_new, args.kill_after)
    many = [
        [rng.randrange(*args.token_range) for _ in range(args.drain_prompt_len)]
        for _ in range(args.drain_requests)
    ]
    drain = drain_run(checkpoint, many, args.max_new, args.kill_after)
    reprefill_s = move["prefill_s"]  # the reference run's one prefill of that prompt
    return {
        "migration_len": args.migrate_len,
        "migration_bytes": move["moved_bytes"],
        "migration_s": move["stall_s"],
        "reprefill_s": round(reprefill_s, 3),
        "migration_vs_reprefill": (
            round(move["stall_s"] / reprefill_s, 4) if move["stall_s"] and reprefill_s else None
        ),
        "migration_reprefilled_tokens": move["reprefilled_tokens"],
        "migration_outputs_identical": move["outputs_identical"],
        "drain_requests": args.drain_requests,
        "drain_moved_reqs": drain["moved_reqs"],
        "drain_moves_followed": drain["moves_followed"],
        "drain_s": drain["drain_s"],
        "drain_stall_s": drain["stall_s"],
        "drain_reprefilled_tokens": drain["reprefilled_tokens"],
        "drain_outputs_identical": drain["outputs_identical"],
        "drain_errors": drain["errors"],
    }


def skew_run(
    checkpoint: Path, prompts: list[list[int]], max_new: int, decode_pages: int, migrate: bool
) -> dict[str, Any]:
    """The prompts at once on a PD stack whose router sends every request to decode node
    D1 (hot); D2 (cold, the same pool) takes only what D1 moves to it, with
    ``migrate``. D1's pool of ``decode_pages`` holds a fraction of the batch at its
    final length, so D1 retracts as its requests grow."""
    tokens = max(map(len, prompts)) * len(prompts) + max_new * len(prompts)
    with tempfile.TemporaryDirectory(prefix="kvo-skew-", dir="/tmp") as tmp, Launcher(tmp) as up:
        decode = ["--num-pages", str(decode_pages)]
        nodes = up.start_pd_stack(
            checkpoint,
            pd_pool(tokens, len(prompts)),
            ["--worker-timeout", "900", "--num-reserved-decode-tokens", str(SKEW_RESERVE)],
            decode_pool=decode,
            migrate_to_pool=decode,
            migrate=migrate,
            transfer_backend="zmq",
            log_level="WARNING",
        )
        run = Run(prompts, max_new, "skew")
        started = time.monotonic()
        asyncio.run(run.serve(nodes["router"].address))
        wall_s = time.monotonic() - started
        stats = {}
        for node in ("d", "d2"):
            with GenerateClient(nodes[f"scheduler-{node}"].address) as client:
                stats[node] = client.info()["stats"]
        for name in ("memsvc-d", "memsvc-d2", "memsvc-p"):
            with MemClient(nodes[name].address) as mem:
                mem.check(idle=True)
    latency, ttft = list(run.latency_s.values()), list(run.ttft_s.values())
    return {
        "latency_p50_s": quantile_s(latency, 0.5),
        "latency_p99_s": quantile_s(latency, 0.99),
        "ttft_p50_s": quantile_s(ttft, 0.5),
        "ttft_p99_s": quantile_s(ttft, 0.99),
        "wall_s": round(wall_s, 2),
        "retracted_reqs": int(stats["d"]["retracted_reqs"]) + int(stats["d2"]["retracted_reqs"]),
        "hot_retracted_reqs": int(stats["d"]["retracted_reqs"]),
        "migrated_reqs": int(stats["d"]["migrated_out_reqs"]),
        "tokens": run.tokens,
        "errors": run.errors,
    }


def measure_skew(args: argparse.Namespace) -> dict[str, Any]:
    """Part 4's skewed load: all traffic on one decode node of two, without moving
    retracted requests to the cold one and with it (the same prompts, greedy)."""
    checkpoint = resolve_model_path(args.model_path)
    rng = random.Random(args.seed + 2)
    prompts = [
        [rng.randrange(*args.token_range) for _ in range(args.skew_prompt_len)]
        for _ in range(args.skew_requests)
    ]
    final = (args.skew_prompt_len + args.skew_max_new) * args.skew_requests
    pages = -(-int(final * args.skew_pool) // PAGE_SIZE)
    runs = {
        name: skew_run(checkpoint, prompts, args.skew_max_new, pages, migrate)
        for name, migrate in (("static", False), ("rebalanced", True))
    }
    static, moved = runs["static"], runs["rebalanced"]
    out: dict[str, Any] = {
        "skew_requests": args.skew_requests,
        "skew_decode_pool_tokens": pages * PAGE_SIZE,
    }
    for name, run in runs.items():
        for key in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "wall_s"):
            out[f"skew_{name}_{key}"] = run[key]
        out[f"skew_{name}_retracted_reqs"] = run["retracted_reqs"]
    out["skew_rebalanced_migrated_reqs"] = moved["migrated_reqs"]
    for key in ("latency_p50_s", "latency_p99_s"):
        out[f"skew_{key[:-2]}_speedup"] = round(static[key] / moved[key], 3)
    out["skew_outputs_identical"] = (
        static["tokens"] == moved["tokens"] and not static["errors"] and not moved["errors"]
    )
    out["skew_errors"] = static["errors"] + moved["errors"]
    return out
