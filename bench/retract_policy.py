"""Retract modes head to head: goodput and p99 latency of recompute, offload and auto.

Three real normal-mode stacks (memsvc, model_svc on the tiny checkpoint,
scheduler_svc) with the same pool, oversubscribed ``--pressure`` times by a
seeded workload of long and short requests (``bench/retract_normal.py``'s),
and the same scheduler flags except ``--retract-mode``. Each stack serves
``--rounds`` workloads, one stack at a time, the order rotating between
rounds so drift on a noisy machine hits all alike.

Prints one JSON object on its last line: per mode ``goodput_tokens_per_s``
(tokens of requests that finished, per wall second), ``p99_latency_s``,
retractions, re-prefilled tokens, offloaded / loaded tokens and the most
retractions any one request had; ``goodput_ratio_auto_vs_recompute`` and
``goodput_ratio_offload_vs_recompute``; and ``outputs_identical`` (all three
must produce the same greedy tokens; exits non-zero if not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import retract_normal
from retract_normal import PAGE_SIZE, Request, pool_args, serve_round, warm_up

from memsvc.client import MemClient
from model_svc.tiny import write_tiny_checkpoint
from scheduler_svc.client import AsyncGenerateClient
from scheduler_svc.launch import Launcher

MODES = ("recompute", "offload", "auto")


def make_workload(args: argparse.Namespace, round_index: int) -> list[Request]:
    """retract_normal's workload, with the long requests' prompts ``--long-prompt`` long.

    Long prompts are what makes re-prefilling a victim expensive (and what a
    long-context serving workload looks like).
    """
    reqs = retract_normal.make_workload(args, round_index)
    lo, hi = (int(x) for x in args.long_prompt.split("-"))
    out = []
    for i, req in enumerate(reqs):
        if "-long-" in req.rid:
            length = lo + (i * 7919) % (hi - lo + 1)
            prompt = (req.prompt_ids * (length // len(req.prompt_ids) + 1))[:length]
            req = Request(req.rid, prompt, req.max_new_tokens)
        out.append(req)
    return out


EXTRA_KEYS = ("offloaded_tokens", "loaded_tokens")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def serve(addresses: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    figures = {
        m: {"wall_s": 0.0, "good_tokens": 0, "latencies": [], "max_retractions": 0}
        for m in addresses
    }
    stats_sum: dict[str, dict[str, int]] = {m: {} for m in addresses}
    identical = True
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            m: await stack.enter_async_context(AsyncGenerateClient(a, timeout_s=600))
            for m, a in addresses.items()
        }
        for client in clients.values():
            await warm_up(client)
        order = list(clients)
        for index in range(args.rounds):
            reqs = make_workload(args, index)
            outputs = {}
            for mode in order[index % len(order) :] + order[: index % len(order)]:
                client = clients[mode]
                before = (await client.info())["stats"]
                results, _, wall_s = await serve_round(client, reqs)
                after = (await client.info())["stats"]
                for key, value in after.items():
                    if isinstance(value, int):
                        stats_sum[mode][key] = stats_sum[mode].get(key, 0) + value - before[key]
                f = figures[mode]
                f["wall_s"] += wall_s
                finished = [r for r in results if r.finish_reason.get("type") != "abort"]
                f["good_tokens"] += sum(len(r.output_ids) for r in finished)
                f["latencies"] += [r.meta_info["e2e_latency"] for r in results]
                f["max_retractions"] = max(
                    f["max_retractions"], *(r.meta_info["num_retractions"] for r in results)
                )
                outputs[mode] = {r.rid: r.output_ids for r in results}
            identical &= all(o == outputs["recompute"] for o in outputs.values())
    out: dict[str, Any] = {}
    for mode, f in figures.items():
        s = stats_sum[mode]
        out[mode] = {
            "goodput_tokens_per_s": round(f["good_tokens"] / f["wall_s"], 2),
            "p99_latency_s": round(p99(f["latencies"]), 3),
            "wall_s": round(f["wall_s"], 2),
            "retracted_reqs": s.get("retracted_reqs", 0),
            "reprefilled_tokens": s.get("reprefilled_tokens", 0),
            **{k: s.get(k, 0) for k in EXTRA_KEYS},
            "aborted_reqs": s.get("aborted_reqs", 0),
            "max_retractions_per_request": f["max_retractions"],
        }
    out["outputs_identical"] = identical
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = make_workload(args, 0)
    demand = sum(r.demand for r in workload)
    pages = int(demand / args.pressure) // PAGE_SIZE
    common = ["--schedule-conservativeness", str(args.schedule_conservativeness)]
    with tempfile.TemporaryDirectory(prefix="retract-policy-") as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny-llama")
        with Launcher(tmp, stop_timeout=10) as launcher:
            stacks = {
                mode: launcher.start_normal_stack(
                    checkpoint,
                    pool_args(pages),
                    [*common, "--retract-mode", mode],
                    suffix=f"-{mode}",
                    log_level="WARNING",
                )
                for mode in MODES
            }
            result = asyncio.run(serve({m: s[2].address for m, s in stacks.items()}, args))
            for mem, _, _ in stacks.values():
                with MemClient(mem.address, name="bench") as client:
                    client.check(idle=True)
            leaked = list(launcher.leaked_segments)
    base = result["recompute"]["goodput_tokens_per_s"]
    return {
        "workload": {
            "seed": args.seed,
            "rounds": args.rounds,
            "num_long": args.num_long,
            "num_short": args.num_short,
            "demand_tokens": demand,
            "capacity_tokens": pages * PAGE_SIZE,
            "schedule_conservativeness": args.schedule_conservativeness,
        },
        **result,
        "goodput_ratio_auto_vs_recompute": round(result["auto"]["goodput_tokens_per_s"] / base, 3),
        "goodput_ratio_offload_vs_recompute": round(
            result["offload"]["goodput_tokens_per_s"] / base, 3
        ),
        "leaked_segments": leaked,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-long", type=int, default=10, help="long requests")
    parser.add_argument("--num-short", type=int, default=10, help="short requests")
    parser.add_argument("--pressure", type=float, default=3.0, help="demand / pool capacity")
    # 0: admit on the hope that requests finish early, so memory runs out mid-decode often.
    parser.add_argument("--schedule-conservativeness", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3, help="workloads served by each stack")
    parser.add_argument(
        "--long-prompt", default="100-200", help="prompt length range of the long requests"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    result = run(args)
    print(f"took {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(json.dumps(result))
    if result["leaked_segments"] or not result["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
