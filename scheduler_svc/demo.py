"""``python -m scheduler_svc.demo``: the normal-mode stack under KV-memory pressure.

Starts memsvc, model_svc (the bundled tiny model) and scheduler_svc twice, on
the embedded defaults (shared-memory pool, CPU): once with a pool so small
that the seeded workload (one request whose prompt nearly fills the pool, as
in the article, plus shorter ones) forces retracts, once with a pool large
enough that nothing is retracted. Prints what each run did and checks that
every output is token-identical (greedy); exits non-zero if not. Leaves no
process or shared-memory segment behind.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient
from scheduler_svc.launch import Launcher

PAGE_SIZE = 4
SMALL_PAGES = 64  # 256 tokens
BIG_PAGES = 2048


def workload(seed: int, count: int, capacity: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    long_len = int(capacity * 0.78)
    reqs = [("long", [rng.randrange(256) for _ in range(long_len)], 40)]
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 24))]
        reqs.append((f"short-{i}", prompt, rng.randint(8, 40)))
    return reqs


async def drive(address: str, reqs: list[tuple[str, list[int], int]]) -> dict[str, Any]:
    started = time.monotonic()
    async with AsyncGenerateClient(address, timeout_s=300) as client:
        results = await asyncio.gather(
            *(
                client.generate(prompt, rid=rid, sampling={"max_new_tokens": n})
                for rid, prompt, n in reqs
            )
        )
        stats = (await client.info())["stats"]
    elapsed = time.monotonic() - started
    latencies = sorted(r.meta_info["e2e_latency"] for r in results)
    return {
        "outputs": {r.rid: r.output_ids for r in results},
        "retractions": sum(r.meta_info["num_retractions"] for r in results),
        "aborts": sum(1 for r in results if r.finish_reason.get("type") == "abort"),
        "generated": stats["generated_tokens"],
        "reprefilled": stats["reprefilled_tokens"],
        "seconds": elapsed,
        "p50_latency": latencies[len(latencies) // 2],
        "p99_latency": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def run_stack(launcher: Launcher, checkpoint: Path, pages: int, reqs, suffix: str, scheduler):
    pool = [
        "--page-size",
        str(PAGE_SIZE),
        "--num-pages",
        str(pages),
        "--max-running-requests",
        "32",
        "--max-context-len",
        "1024",
    ]
    mem, _, sched = launcher.start_normal_stack(checkpoint, pool, scheduler, suffix=suffix)
    result = asyncio.run(drive(sched.address, reqs))
    with MemClient(mem.address) as client:
        client.check(idle=True)  # every page back where it belongs
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--requests", type=int, default=12, help="short requests")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from model_svc.tiny import default_checkpoint

    checkpoint = default_checkpoint()
    reqs = workload(args.seed, args.requests, SMALL_PAGES * PAGE_SIZE)
    demand = sum(len(p) + n for _, p, n in reqs)
    print(
        f"workload: {len(reqs)} requests, {demand} tokens of demand "
        f"(prompt + max_new); long prompt {len(reqs[0][1])} tokens"
    )
    with tempfile.TemporaryDirectory(prefix="kvstack-demo-") as tmp, Launcher(tmp) as launcher:
        print(f"pressure run: pool of {SMALL_PAGES * PAGE_SIZE} tokens ...", flush=True)
        pressure = run_stack(
            launcher,
            checkpoint,
            SMALL_PAGES,
            reqs,
            "-small",
            ["--schedule-conservativeness", "0.3"],
        )
        print(f"reference run: pool of {BIG_PAGES * PAGE_SIZE} tokens ...", flush=True)
        reference = run_stack(launcher, checkpoint, BIG_PAGES, reqs, "-big", [])

    header = (
        f"{'run':<10}{'retractions':>12}{'re-prefilled':>14}{'generated':>11}"
        f"{'aborts':>8}{'tok/s':>9}{'p50 s':>8}{'p99 s':>8}"
    )
    print("\n" + header)
    for name, r in (("pressure", pressure), ("reference", reference)):
        print(
            f"{name:<10}{r['retractions']:>12}{r['reprefilled']:>14}{r['generated']:>11}"
            f"{r['aborts']:>8}{r['generated'] / r['seconds']:>9.0f}{r['p50_latency']:>8.2f}"
            f"{r['p99_latency']:>8.2f}"
        )
    identical = pressure["outputs"] == reference["outputs"]
    if identical:
        print(f"\nall {len(reqs)} outputs are token-identical to the no-pressure reference")
        print("memsvc idle check passed on both pools: no page leaked")
        return 0
    differing = [
        rid
        for rid in reference["outputs"]
        if pressure["outputs"].get(rid) != reference["outputs"][rid]
    ]
    print(f"\nFAIL: {len(differing)} outputs differ from the reference: {differing[:8]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
