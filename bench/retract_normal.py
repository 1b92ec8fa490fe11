"""What normal-mode retract costs: one workload under memory pressure vs in a pool that fits it.

Starts two real stacks (``python -m memsvc``, ``python -m model_svc`` over
the tiny checkpoint, ``python -m scheduler_svc``) with the same scheduler
flags (``--schedule-conservativeness 0.3``: admission counts on running
requests needing little of their remaining output, so a small pool runs out
mid-decode and retracts) and different pools:

- ``pressure``: capacity ``demand / --pressure`` tokens (2-3x oversubscribed);
- ``baseline``: ``4 x demand`` tokens, where nothing is retracted;

where ``demand`` is the workload's Σ (prompt + max_new_tokens). The workload
is seeded: a few long requests (long prompts, long outputs) and many short
ones, all submitted at once (greedy sampling, EOS honoured). Each stack
serves ``--rounds`` such workloads (same shapes, fresh prompt tokens, so no
round hits the prefix cache another filled), one stack at a time and in
alternating order, so that drift on a noisy machine hits both sides of the
ratio alike. A warm-up request per stack comes first, untimed and left out.

Prints one JSON object on its last line, figures summed over the rounds
(``workload``'s token counts are per round)::

    {"workload": {..}, "pressure": {"retracted_reqs": .., "reprefilled_tokens": ..,
     "generated_tokens": .., "wall_s": .., "tokens_per_s": .., ..}, "baseline": {..},
     "slowdown": .., "rounds": [{"slowdown": .., ..}, ..], "outputs_identical": true}

``slowdown`` = (pressure wall seconds per generated token) / (baseline's).
Exits non-zero if any round's outputs differ between the stacks (retract
must not change a greedy result) or a service left shared memory behind.
The services inherit this process's environment (``MALLOC_*`` included).
Run with the repository on ``PYTHONPATH`` (or kvstack installed, as ``make`` does).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from model_svc.tiny import BOS_ID, write_tiny_checkpoint
from scheduler_svc.client import AsyncGenerateClient, GenerateResult

PAGE_SIZE = 4
MAX_RUNNING_REQUESTS = 32
MAX_CONTEXT_LEN = 1024
BASELINE_FACTOR = 4  # the baseline pool holds this many times the workload's demand
STOP_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 300.0
# BOS repeated: never a prefix of the byte-valued workload prompts, so no cache hits.
WARMUP_PROMPT = [BOS_ID] * 8


@dataclass(frozen=True)
class Request:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int

    @property
    def demand(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


def make_workload(args: argparse.Namespace, round_index: int) -> list[Request]:
    """Long and short requests, shuffled together.

    The shapes (order, prompt lengths, ``max_new_tokens``) depend on ``--seed``
    only, so every round has the same demand; the prompt tokens on the round
    too, so that no round hits the prefix cache an earlier one filled.
    """
    shape_rng = random.Random(args.seed)
    token_rng = random.Random(f"{args.seed}-{round_index}")
    shapes = [("long", (100, 200), (160, 256))] * args.num_long
    shapes += [("short", (8, 32), (48, 128))] * args.num_short
    shape_rng.shuffle(shapes)
    reqs = []
    for i, (kind, (p_lo, p_hi), (n_lo, n_hi)) in enumerate(shapes):
        prompt_len, max_new = shape_rng.randint(p_lo, p_hi), shape_rng.randint(n_lo, n_hi)
        prompt = [token_rng.randrange(256) for _ in range(prompt_len)]
        reqs.append(Request(f"r{round_index}-{kind}-{i}", prompt, max_new))
    return reqs


def pool_args(num_pages: int, max_context_len: int = MAX_CONTEXT_LEN) -> list[str]:
    """memsvc pool flags past the tiny model's geometry (which the launcher adds)."""
    return [
        "--page-size", str(PAGE_SIZE),
        "--num-pages", str(num_pages),
        "--max-running-requests", str(MAX_RUNNING_REQUESTS),
        "--max-context-len", str(max_context_len),
    ]  # fmt: skip


# -- rounds ------------------------------------------------------------------------


STAT_KEYS = (
    "retracted_reqs",
    "retract_events",
    "reprefilled_tokens",
    "prefill_tokens",
    "generated_tokens",
    "forward_passes",
    "finished_reqs",
    "aborted_reqs",
)
Outputs = dict[str, tuple[list[int], Any]]  # rid -> (output ids, finish reason)


@dataclass
class Totals:
    """One stack's figures, summed over the rounds."""

    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0))
    num_retractions: int = 0  # from the results' meta_info, to cross-check the stats
    wall_s: float = 0.0

    def add(self, stats: dict[str, int], results: list[GenerateResult], wall_s: float) -> None:
        for key in STAT_KEYS:
            self.stats[key] += stats[key]
        self.num_retractions += sum(r.meta_info["num_retractions"] for r in results)
        self.wall_s += wall_s

    @property
    def s_per_token(self) -> float:
        return self.wall_s / max(self.stats["generated_tokens"], 1)

    def figures(self, num_pages: int, demand: int) -> dict[str, Any]:
        return {
            "num_pages": num_pages,
            "capacity_tokens": num_pages * PAGE_SIZE,
            "demand_over_capacity": round(demand / (num_pages * PAGE_SIZE), 2),
            **self.stats,
            "num_retractions": self.num_retractions,
            "wall_s": round(self.wall_s, 3),
            "tokens_per_s": round(self.stats["generated_tokens"] / self.wall_s, 1),
        }


async def warm_up(client: AsyncGenerateClient) -> None:
    await client.generate(WARMUP_PROMPT, rid="warmup", sampling={"max_new_tokens": 4})


async def serve_round(
    client: AsyncGenerateClient, reqs: list[Request]
) -> tuple[list[GenerateResult], dict[str, int], float]:
    """Submit the whole workload at once; the results, the round's stats, wall seconds."""
    before = (await client.info())["stats"]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.generate(r.prompt_ids, rid=r.rid, sampling={"max_new_tokens": r.max_new_tokens})
            for r in reqs
        )
    )
    wall_s = time.perf_counter() - start
    after = (await client.info())["stats"]
    return results, {key: after[key] - before[key] for key in STAT_KEYS}, wall_s


async def serve_rounds(
    addresses: dict[str, str], args: argparse.Namespace
) -> tuple[dict[str, Totals], list[dict[str, float]], bool]:
    """Every round on every stack, one stack at a time, the order alternating between rounds.

    Returns each stack's totals, each round's figures and whether every round's outputs
    were the same on every stack.
    """
    totals = {name: Totals() for name in addresses}
    rounds: list[dict[str, float]] = []
    identical = True
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            name: await stack.enter_async_context(
                AsyncGenerateClient(address, timeout_s=REQUEST_TIMEOUT_S)
            )
            for name, address in addresses.items()
        }
        for client in clients.values():
            await warm_up(client)
        names = list(clients)
        for index in range(args.rounds):
            reqs = make_workload(args, index)
            outputs: dict[str, Outputs] = {}
            s_per_token: dict[str, float] = {}
            figures: dict[str, float] = {}
            # Alternate the order, so that drift on a noisy machine hits both stacks alike.
            for name in names if index % 2 == 0 else names[::-1]:
                results, stats, wall_s = await serve_round(clients[name], reqs)
                totals[name].add(stats, results, wall_s)
                outputs[name] = {r.rid: (r.output_ids, r.finish_reason) for r in results}
                s_per_token[name] = wall_s / max(stats["generated_tokens"], 1)
                figures[f"{name}_wall_s"] = round(wall_s, 3)
                if name == "pressure":
                    figures["retracted_reqs"] = stats["retracted_reqs"]
            identical &= outputs["pressure"] == outputs["baseline"]
            figures["slowdown"] = round(s_per_token["pressure"] / s_per_token["baseline"], 3)
            rounds.append(figures)
    return totals, rounds, identical


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    workload = make_workload(args, 0)  # every round's shapes, so its demand too
    demand = sum(r.demand for r in workload)
    num_pages = {
        "pressure": int(demand / args.pressure) // PAGE_SIZE,
        "baseline": -(-demand * BASELINE_FACTOR // PAGE_SIZE),
    }
    scheduler_args = ["--schedule-conservativeness", str(args.schedule_conservativeness)]
    with tempfile.TemporaryDirectory(prefix="retract-bench-") as tmp:
        workdir = Path(tmp)
        checkpoint = write_tiny_checkpoint(workdir / "tiny-llama")
        # Stopped last started first (each stack's scheduler, model, memsvc), leftover shm
        # segments unlinked and kept in launcher.leaked_segments.
        with Launcher(workdir, stop_timeout=STOP_TIMEOUT_S) as launcher:
            stacks = {
                name: launcher.start_normal_stack(
                    checkpoint,
                    pool_args(pages),
                    scheduler_args,
                    suffix=f"-{name}",
                    log_level="WARNING",
                )
                for name, pages in num_pages.items()
            }
            totals, rounds, identical = asyncio.run(
                serve_rounds({name: sched.address for name, (_, _, sched) in stacks.items()}, args)
            )
            for mem, _, _ in stacks.values():
                with MemClient(mem.address, name="bench") as client:
                    client.check(idle=True)  # everything released, the pool consistent
    result = {
        "workload": {
            "seed": args.seed,
            "rounds": args.rounds,
            "num_long": args.num_long,
            "num_short": args.num_short,
            "prompt_tokens": sum(len(r.prompt_ids) for r in workload),
            "max_new_tokens": sum(r.max_new_tokens for r in workload),
            "demand_tokens": demand,
            "page_size": PAGE_SIZE,
            "max_running_requests": MAX_RUNNING_REQUESTS,
            "schedule_conservativeness": args.schedule_conservativeness,
        },
        **{name: totals[name].figures(pages, demand) for name, pages in num_pages.items()},
        "slowdown": round(totals["pressure"].s_per_token / totals["baseline"].s_per_token, 3),
        "rounds": rounds,
        "outputs_identical": identical,
    }
    return result, launcher.leaked_segments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-long", type=int, default=4, help="long requests")
    parser.add_argument("--num-short", type=int, default=36, help="short requests")
    parser.add_argument(
        "--pressure", type=float, default=2.8, help="demand / small pool capacity (2-3)"
    )
    parser.add_argument("--schedule-conservativeness", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=3, help="workloads served by each stack")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like an error: every service is still stopped and reaped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    result, leaked = run(args)
    print(f"took {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(json.dumps(result))
    if leaked:
        print(f"services left shm segments, removed: {leaked}", file=sys.stderr)
    if not result["outputs_identical"]:
        print("the pressure run's outputs differ from the baseline's", file=sys.stderr)
    if leaked or not result["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
