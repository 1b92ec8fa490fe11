"""Where the hierarchical cache spends time on short-turn multi-turn chat (issue 34).

Starts one radix-only stack and one hierarchy stack per ``--policies`` entry
(SmolLM2 on the CPU, the same pool) and serves the same workload on each,
``--rounds`` times, the order rotating, one stack at a time: ``--conversations``
chats of ``--turns`` turns sharing a ``--system-len``-token system prompt,
``--user-len`` new tokens per turn, ``--in-flight`` chats at a time, streaming,
greedy ``--output-len``-token replies (``bench/hicache_workload``'s ``chat`` kind, or
``--kind``, e.g. ``unique``, the no-reuse control, with ``--system-len 0``).

Per stack it reports TTFT p50 / p99, requests per second, and what the run cost
where: CPU seconds of each service's process and of memsvc's threads (the copy
thread runs the host-tier copies: on two cores it competes with the worker),
memsvc's ``hicache`` counters (load / backup bytes and seconds, loads skipped
as not worth it), the scheduler's stats (prefill seconds, loads waited for).
Prints one JSON object on its last line. Run with the repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache import run_chat  # bench/, the script's folder
from hicache_workload import KINDS, Chat, Encoder, Workload, sized

from kvstack.model.paths import resolve_model_path
from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient

PAGE_SIZE = 16
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> dict[str, float]:
    """The process's CPU seconds in all, and per thread name (summed over same names)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) / TICK
        out[f"thread:{name}"] = out.get(f"thread:{name}", 0.0) + seconds
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["total"] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def numbers(obj: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out |= numbers(value, f"{prefix}{key}.")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = obj
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0), 6) for k, v in after.items() if v != before.get(k, 0)}


async def serve_round(address: str, chats: list[Chat], args: Any, eot: list[int]) -> dict:
    async with AsyncGenerateClient(address, timeout_s=600) as client:
        gate = asyncio.Semaphore(args.in_flight)

        async def one(chat: Chat) -> list:
            async with gate:
                await run_chat(client, chat, args.output_len, eot)
            return [(t.ttft_s, t.output_ids) for t in chat.turns]

        before = numbers((await client.info())["stats"])
        start = time.perf_counter()
        turns = await asyncio.gather(*(one(c) for c in chats))
        wall = time.perf_counter() - start
        after = numbers((await client.info())["stats"])
    return {"wall_s": wall, "turns": turns, "sched": delta(before, after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kind", default="chat", choices=sorted(KINDS), help="hicache_workload's workload kind"
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=120)
    parser.add_argument("--user-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--pool-tokens", type=int, default=3072)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="write_through", help="comma list, hicache stacks")
    parser.add_argument("--hicache-flags", default="", help="extra memsvc flags, hicache stacks")
    args = parser.parse_args()
    checkpoint = resolve_model_path(args.model_path)
    spec = sized(
        KINDS[args.kind],
        conversations=args.conversations,
        turns=args.turns,
        system_len=args.system_len,
        turn_len=args.user_len,
        output_len=args.output_len,
        in_flight=args.in_flight,
    )
    workload = Workload(Encoder(checkpoint), spec, args.seed)
    pool = ["--page-size", str(PAGE_SIZE), "--num-pages", str(args.pool_tokens // PAGE_SIZE),
            "--max-running-requests", "64", "--max-context-len", "2048"]  # fmt: skip
    names = ["radix"] + [f"hicache_{p}" for p in args.policies.split(",")]
    results: dict[str, dict[str, Any]] = {n: {"rounds": []} for n in names}
    with tempfile.TemporaryDirectory() as tmp, Launcher(tmp, stop_timeout=10) as launcher:
        stacks = {}
        for name in names:
            flags = list(pool)
            if name != "radix":
                flags += ["--enable-hierarchical-cache", "--hicache-write-policy", name[8:]]
                flags += args.hicache_flags.split()
            stacks[name] = launcher.start_normal_stack(
                checkpoint, flags, suffix=f"-{name}", log_level="WARNING"
            )
        for _, _, sched in stacks.values():  # warm-up, untimed
            asyncio.run(serve_round(sched.address, workload.chats(1000)[:1], args, []))
        for index in range(args.rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            for name in order:
                mem, model, sched = stacks[name]
                procs = {"memsvc": mem, "model_svc": model, "scheduler_svc": sched}
                cpu0 = {k: cpu_seconds(s.proc.pid) for k, s in procs.items()}
                with MemClient(mem.address, name="prof") as c:
                    hc0 = numbers(c.stats().get("hicache") or {})
                r = asyncio.run(
                    serve_round(sched.address, workload.chats(index), args, workload.end_of_turn)
                )
                with MemClient(mem.address, name="prof") as c:
                    hc1 = numbers(c.stats().get("hicache") or {})
                cpu1 = {k: cpu_seconds(s.proc.pid) for k, s in procs.items()}
                r["cpu"] = {k: delta(cpu0[k], cpu1[k]) for k in procs}
                r["hicache"] = delta(hc0, hc1)
                results[name]["rounds"].append(r)
                print(f"round {index} {name}: {r['wall_s']:.2f}s", file=sys.stderr, flush=True)
        for name, (mem, _, _) in stacks.items():
            with MemClient(mem.address, name="prof") as c:
                c.check(idle=True)
                cost = (c.stats().get("hicache") or {}).get("load_cost_model")
            results[name]["load_cost_model"] = cost
    out: dict[str, Any] = {"args": vars(args)}
    ref = None
    for name in names:
        rounds = results[name]["rounds"]
        ttft = sorted(t for r in rounds for chat in r["turns"] for t, _ in chat)
        outputs = [[o for _, o in chat] for r in rounds for chat in r["turns"]]
        ref = ref or outputs
        per_round = [r["wall_s"] for r in rounds]
        rps = [sum(len(c) for c in r["turns"]) / r["wall_s"] for r in rounds]
        keys = {k for r in rounds for part in ("sched", "hicache") for k in r[part]}
        summed = {
            part: {
                k: round(statistics.median(r[part].get(k, 0) for r in rounds), 4)
                for k in sorted({k for r in rounds for k in r[part]})
            }
            for part in ("sched", "hicache")
        }
        cpu = {
            proc: {
                k: round(statistics.median(r["cpu"][proc].get(k, 0) for r in rounds), 3)
                for k in sorted({k for r in rounds for k in r["cpu"][proc]})
            }
            for proc in rounds[0]["cpu"]
        }
        del keys
        out[name] = {
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 4),
            "ttft_p50_per_round": [
                round(statistics.median(t for chat in r["turns"] for t, _ in chat), 4)
                for r in rounds
            ],
            "wall_s_per_round": [round(w, 2) for w in per_round],
            "requests_per_s_median": round(statistics.median(rps), 3),
            "cpu_s_median": cpu,
            **summed,
            "outputs_identical_to_radix": outputs == ref,
            "load_cost_model": results[name]["load_cost_model"],
        }
        if name != "radix":
            out[name]["ttft_p50_speedup"] = round(
                out["radix"]["ttft_p50_s"] / out[name]["ttft_p50_s"], 3
            )
            out[name]["throughput_ratio"] = round(
                out[name]["requests_per_s_median"] / out["radix"]["requests_per_s_median"], 3
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
