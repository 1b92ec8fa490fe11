"""Where the hierarchical cache spends time, against radix-only, on one of bench/hicache.py's
workloads (issue 34).

Starts ``--radix`` radix-only stacks and one hierarchy stack per ``--policies`` entry
(SmolLM2 on the CPU, the same pool: ``--pool-tokens``, or ``--pressure`` sized as
bench/hicache.py's cells, its host tier ``--hicache-ratio`` pools) and serves the same
workload on each, ``--rounds`` times, the order rotating, one stack at a time, as
bench/hicache.py serves a cell (a shared prefix's first chat opens each round alone):
``--kind``'s conversations (``chat``, ``docs``, ``agent``, or ``unique``, the no-reuse
control), at that kind's sizes unless ``--conversations`` ... ``--in-flight`` say
otherwise. A second radix-only stack (``--radix 2``) measures what two identical
stacks differ by on this machine in the same run.

Per stack it reports TTFT p50 / p99, requests per second, wall time and the worker's
CPU seconds per round, and what the run cost where: CPU seconds of each service's
process and of memsvc's threads (the copy thread runs the host-tier copies: on two
cores it competes with the worker), memsvc's ``hicache`` counters (load / backup bytes
and seconds, loads skipped as not worth it), the scheduler's stats (prefill and decode
seconds, forward passes). Prints one JSON object on its last line. Run with the
repository on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from hicache import PAGE_SIZE, cell_pool, pool_args  # bench/, the script's folder
from hicache_serve import serve_round as bench_serve_round
from hicache_workload import KINDS, Encoder, Workload, sized

from kvstack.model.paths import resolve_model_path
from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient

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


async def serve_round(address: str, workload: Workload, index: int) -> dict:
    """Round ``index`` of the workload as bench/hicache.py serves it (a shared prefix's
    first chat opens the round alone); wall time, each turn's TTFT and reply, and every
    scheduler stat's change over the round."""
    chats = workload.chats(index)
    async with AsyncGenerateClient(address, timeout_s=600) as client:
        before = numbers((await client.info())["stats"])
        figures = await bench_serve_round(client, chats, workload)
        after = numbers((await client.info())["stats"])
    turns = [[(t.ttft_s, t.output_ids) for t in chat.turns] for chat in chats]
    return {"wall_s": figures["wall_s"], "turns": turns, "sched": delta(before, after)}


def median(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kind", default="chat", choices=sorted(KINDS), help="hicache_workload's workload kind"
    )
    sizes = parser.add_argument_group("sizes (default: the kind's own, as in bench/hicache.py)")
    sizes.add_argument("--conversations", type=int)
    sizes.add_argument("--turns", type=int)
    sizes.add_argument("--system-len", type=int)
    sizes.add_argument("--user-len", type=int)
    sizes.add_argument("--output-len", type=int)
    sizes.add_argument("--in-flight", type=int)
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--pool-tokens", type=int, help="device pool tokens")
    pool.add_argument(
        "--pressure", type=float, help="working set / device pool, as bench/hicache.py's cells"
    )
    parser.add_argument("--hicache-ratio", type=float, default=6.0, help="host tier / pool")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policies", default="write_through", help="comma list, hicache stacks")
    parser.add_argument(
        "--radix", type=int, default=1, help="radix-only stacks (2: a second one measures "
        "the noise between two identical stacks)"
    )  # fmt: skip
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
    if args.pool_tokens is not None:
        num_pages, max_context_len = args.pool_tokens // PAGE_SIZE, 2048
    else:
        num_pages, max_context_len = cell_pool(workload, args.pressure or 0.8)
    pool = pool_args(num_pages, max_context_len)
    radix = ["radix"] + [f"radix_{i}" for i in range(2, args.radix + 1)]
    names = radix + [f"hicache_{p}" for p in args.policies.split(",")]
    results: dict[str, dict[str, Any]] = {n: {"rounds": []} for n in names}
    loadavg = []
    with tempfile.TemporaryDirectory() as tmp, Launcher(tmp, stop_timeout=10) as launcher:
        stacks = {}
        for name in names:
            flags = list(pool)
            if name.startswith("hicache_"):
                flags += ["--enable-hierarchical-cache", "--hicache-write-policy", name[8:]]
                flags += ["--hicache-ratio", str(args.hicache_ratio)]
                flags += args.hicache_flags.split()
            stacks[name] = launcher.start_normal_stack(
                checkpoint, flags, suffix=f"-{name}", log_level="WARNING"
            )
        for _, _, sched in stacks.values():  # warm-up, untimed
            asyncio.run(serve_round(sched.address, workload, 1000))
        for index in range(args.rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            loadavg.append(round(os.getloadavg()[0], 2))
            for name in order:
                mem, model, sched = stacks[name]
                procs = {"memsvc": mem, "model_svc": model, "scheduler_svc": sched}
                cpu0 = {k: cpu_seconds(s.proc.pid) for k, s in procs.items()}
                with MemClient(mem.address, name="prof") as c:
                    hc0 = numbers(c.stats().get("hicache") or {})
                r = asyncio.run(serve_round(sched.address, workload, index))
                with MemClient(mem.address, name="prof") as c:
                    hc1 = numbers(c.stats().get("hicache") or {})
                cpu1 = {k: cpu_seconds(s.proc.pid) for k, s in procs.items()}
                r["cpu"] = {k: delta(cpu0[k], cpu1[k]) for k in procs}
                r["hicache"] = delta(hc0, hc1)
                results[name]["rounds"].append(r)
                worker = r["cpu"]["model_svc"]["total"]
                print(
                    f"round {index} {name}: {r['wall_s']:.2f}s, worker CPU {worker:.1f}s, "
                    f"load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
        for name, (mem, _, _) in stacks.items():
            with MemClient(mem.address, name="prof") as c:
                c.check(idle=True)
                cost = (c.stats().get("hicache") or {}).get("load_cost_model")
            results[name]["load_cost_model"] = cost
    out: dict[str, Any] = {
        "args": vars(args),
        "device_pool_tokens": num_pages * PAGE_SIZE,
        "working_set_tokens": workload.working_set()[0],
        "loadavg_per_round": loadavg,
    }
    ref = None
    for name in names:
        rounds = results[name]["rounds"]
        ttft = sorted(t for r in rounds for chat in r["turns"] for t, _ in chat)
        outputs = [[o for _, o in chat] for r in rounds for chat in r["turns"]]
        ref = ref or outputs
        rps = [sum(len(c) for c in r["turns"]) / r["wall_s"] for r in rounds]
        summed = {
            part: {
                k: median([r[part].get(k, 0) for r in rounds])
                for k in sorted({k for r in rounds for k in r[part]})
            }
            for part in ("sched", "hicache")
        }
        cpu = {
            proc: {
                k: median([r["cpu"][proc].get(k, 0) for r in rounds], 3)
                for k in sorted({k for r in rounds for k in r["cpu"][proc]})
            }
            for proc in rounds[0]["cpu"]
        }
        out[name] = {
            "ttft_p50_s": median(ttft),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 4),
            "ttft_p50_per_round": [
                median([t for chat in r["turns"] for t, _ in chat]) for r in rounds
            ],
            "wall_s_per_round": [round(r["wall_s"], 2) for r in rounds],
            "worker_cpu_s_per_round": [r["cpu"]["model_svc"]["total"] for r in rounds],
            "memsvc_cpu_s_per_round": [r["cpu"]["memsvc"]["total"] for r in rounds],
            "requests_per_s_median": median(rps, 3),
            "cpu_s_median": cpu,
            **summed,
            "outputs_identical_to_radix": outputs == ref,
            "load_cost_model": results[name]["load_cost_model"],
        }
        if name != "radix":
            base = out["radix"]
            out[name]["ttft_p50_speedup"] = round(base["ttft_p50_s"] / out[name]["ttft_p50_s"], 3)
            out[name]["throughput_ratio"] = round(
                out[name]["requests_per_s_median"] / base["requests_per_s_median"], 3
            )
            walls = zip(base["wall_s_per_round"], out[name]["wall_s_per_round"], strict=True)
            # radix-only's wall time over this stack's, round by round
            out[name]["wall_ratio_per_round"] = [round(a / b, 3) for a, b in walls]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
