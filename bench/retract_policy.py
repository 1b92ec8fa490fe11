"""Retract modes head to head: goodput and p99 latency of recompute, offload and auto.

Three real normal-mode stacks (memsvc, model_svc on the tiny checkpoint,
scheduler_svc), one per ``--retract-mode``, with the same pool and the same
scheduler flags otherwise. Each stack serves ``--rounds`` workloads, one
stack at a time, the order rotating between rounds so drift on a noisy
machine hits all alike. A warm-up request per stack comes first, untimed.

The workload (seeded; every figure is in the JSON's ``workload``) is a
pressure workload: the case where what a victim's KV becomes matters.

- ``--num-requests`` requests (default 16), all submitted at t=0, greedy,
  EOS honoured (the tiny model stops some early, as real ones do);
- long prompts (``--prompt-len``, default 300-900 tokens, 10-30x a short chat
  turn): re-prefilling a victim recomputes its prompt once the prefix tree
  has evicted it, while offload + load copies its KV twice. (Longer prompts
  retract no more often and make every decode step slower: on two CPU cores a
  step of three requests over ~1k tokens of context each took ~27 ms.)
- outputs (``--output-len``, ``max_new_tokens``, default 300-600) long
  enough that decode growth overflows a pool admission over-committed;
- the pool holds ``Σ (prompt + max_new_tokens) / --pressure`` tokens (default
  4: about three requests at a time), and admission over-commits
  (``--schedule-conservativeness 0.3``: running requests reserve 0.21 of
  their remaining output at first, decaying to 0.03).

Shapes depend on ``--seed`` only (every round has the same demand); prompt
tokens on the round too, so no round hits the prefix cache another filled.

Prints one JSON object on its last line: per mode ``goodput_tokens_per_s``
(output tokens of requests that finished, per wall second), ``p99_latency_s``,
retractions (events, requests, the most any one request had), re-prefilled,
offloaded and loaded tokens, and the scheduler's wall seconds in prefill
(``reprefill_s`` of it on retracted requests), decode, retract (offload copies
included) and host-store loads, with ``retract_cost_share`` = (reprefill_s +
retract_s + load_s) / wall_s: the most any retract mode could save;
``goodput_ratio_auto_vs_recompute`` and ``goodput_ratio_offload_vs_recompute``
over all rounds and per round (``rounds``); and ``outputs_identical`` (all
three must produce the same greedy tokens; exits non-zero if not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retract_normal import PAGE_SIZE, Request, pool_args, serve_round, warm_up

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from model_svc.tiny import write_tiny_checkpoint
from scheduler_svc.client import AsyncGenerateClient

MODES = ("recompute", "offload", "auto")


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def make_workload(args: argparse.Namespace, round_index: int) -> list[Request]:
    """``--num-requests`` requests: prompt and output lengths uniform in their ranges."""
    shape_rng = random.Random(args.seed)
    token_rng = random.Random(f"{args.seed}-{round_index}")
    prompt_lo, prompt_hi = parse_range(args.prompt_len)
    output_lo, output_hi = parse_range(args.output_len)
    reqs = []
    for i in range(args.num_requests):
        prompt_len = shape_rng.randint(prompt_lo, prompt_hi)
        max_new = shape_rng.randint(output_lo, output_hi)
        prompt = [token_rng.randrange(256) for _ in range(prompt_len)]
        reqs.append(Request(f"r{round_index}-{i}", prompt, max_new))
    return reqs


# Engine counters reported per mode, summed over the rounds.
COUNT_KEYS = (
    "retract_events",
    "retracted_reqs",
    "reprefilled_tokens",
    "offloaded_tokens",
    "loaded_tokens",
    "prefill_tokens",
    "generated_tokens",
    "forward_passes",
    "aborted_reqs",
)
SECONDS_KEYS = ("prefill_s", "reprefill_s", "decode_s", "retract_s", "load_s")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def serve(addresses: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    figures = {
        m: {"wall_s": 0.0, "good_tokens": 0, "latencies": [], "max_retractions": 0}
        for m in addresses
    }
    totals: dict[str, dict[str, float]] = {m: {} for m in addresses}
    rounds: list[dict[str, Any]] = []
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
            goodput = {}
            for mode in order[index % len(order) :] + order[: index % len(order)]:
                client = clients[mode]
                before = (await client.info())["stats"]
                results, _, wall_s = await serve_round(client, reqs)
                after = (await client.info())["stats"]
                for key in (*COUNT_KEYS, *SECONDS_KEYS):
                    totals[mode][key] = totals[mode].get(key, 0) + after[key] - before[key]
                f = figures[mode]
                f["wall_s"] += wall_s
                finished = [r for r in results if r.finish_reason.get("type") != "abort"]
                good_tokens = sum(len(r.output_ids) for r in finished)
                f["good_tokens"] += good_tokens
                f["latencies"] += [r.meta_info["e2e_latency"] for r in results]
                f["max_retractions"] = max(
                    f["max_retractions"], *(r.meta_info["num_retractions"] for r in results)
                )
                outputs[mode] = {r.rid: r.output_ids for r in results}
                goodput[mode] = good_tokens / wall_s
            identical &= all(o == outputs["recompute"] for o in outputs.values())
            rounds.append(
                {
                    "first": order[index % len(order)],
                    **{f"{m}_goodput": round(g, 2) for m, g in goodput.items()},
                    "ratio_auto_vs_recompute": round(goodput["auto"] / goodput["recompute"], 3),
                }
            )
    out: dict[str, Any] = {}
    for mode, f in figures.items():
        t = totals[mode]
        retract_cost_s = t["reprefill_s"] + t["retract_s"] + t["load_s"]
        out[mode] = {
            "goodput_tokens_per_s": round(f["good_tokens"] / f["wall_s"], 2),
            "p99_latency_s": round(p99(f["latencies"]), 3),
            "wall_s": round(f["wall_s"], 2),
            **{k: int(t[k]) for k in COUNT_KEYS},
            "max_retractions_per_request": f["max_retractions"],
            **{k: round(t[k], 3) for k in SECONDS_KEYS},
            "retract_cost_share": round(retract_cost_s / f["wall_s"], 4),
        }
    out["rounds"] = rounds
    out["outputs_identical"] = identical
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = make_workload(args, 0)  # every round's shapes, so its demand too
    demand = sum(r.demand for r in workload)
    pages = int(demand / args.pressure) // PAGE_SIZE
    longest = max(r.demand for r in workload)
    max_context_len = max(1024, -(-longest // 1024) * 1024)
    common = ["--schedule-conservativeness", str(args.schedule_conservativeness)]
    with tempfile.TemporaryDirectory(prefix="retract-policy-") as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny-llama")
        with Launcher(tmp, stop_timeout=10) as launcher:
            stacks = {
                mode: launcher.start_normal_stack(
                    checkpoint,
                    pool_args(pages, max_context_len),
                    [*common, "--retract-mode", mode],
                    suffix=f"-{mode}",
                    log_level="WARNING",
                )
                for mode in args.modes
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
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "prompt_tokens": sum(len(r.prompt_ids) for r in workload),
            "max_new_tokens": sum(r.max_new_tokens for r in workload),
            "demand_tokens": demand,
            "pressure": args.pressure,
            "capacity_tokens": pages * PAGE_SIZE,
            "page_size": PAGE_SIZE,
            "arrivals": "all at t=0",
            "launch_order": args.modes,
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
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", default="300-900", help="prompt length range, LO-HI")
    parser.add_argument(
        "--output-len", default="300-600", help="max_new_tokens range, LO-HI tokens"
    )
    parser.add_argument("--pressure", type=float, default=4.0, help="demand / pool capacity")
    # Below 1, admission counts on running requests needing little of their remaining
    # output, so memory runs out mid-decode (SGLang's advice is 1.2-1.5 when that happens).
    parser.add_argument("--schedule-conservativeness", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=3, help="workloads served by each stack")
    parser.add_argument(
        "--launch-order",
        dest="modes",
        type=lambda text: text.split(","),
        default=list(MODES),
        help="the three modes in the order their stacks start (and the rotation starts)",
    )
    args = parser.parse_args(argv)
    if sorted(args.modes) != sorted(MODES):
        parser.error(f"--launch-order must name each of {MODES} once")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    result = run(args)
    print(f"took {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(json.dumps(result))
    if result["leaked_segments"] or not result["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
