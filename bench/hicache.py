"""The hierarchical prefix cache against radix-only, on a multi-turn chat workload.

Two real normal-mode stacks (memsvc, model_svc, scheduler_svc) on SmolLM2-135M-
Instruct (``--model-path``, the real model by default), the same device pool
and the same scheduler flags; one runs memsvc with ``--enable-hierarchical-cache``
(host tier, and with ``--storage-dir`` a file disk tier), the other radix-only.
Each stack serves the whole workload, one stack at a time, the order rotating
between ``--rounds`` (each round has fresh conversations, so no round hits what
an earlier one cached). A warm-up request per stack comes first, untimed.

The workload (seeded; every figure is in the JSON's ``workload``):

- ``--conversations`` chats (default 8) of ``--turns`` turns (default 6), all
  started at t=0; a chat sends its next turn as soon as the reply to the last
  one is complete (a closed loop of one user per chat). The issue's example,
  32 x 6, is ``--conversations 32``: about four times the run time;
- every chat opens with the same system prompt (``--system-len`` tokens of
  it), and each turn is the whole history so far (system prompt, earlier user
  turns and the model's own replies, token for token) plus a new user message
  (``--user-len`` tokens of a chat-specific passage), rendered in the model's
  chat template (ChatML for SmolLM2);
- replies are greedy and exactly ``--output-len`` tokens (default 4,
  ``ignore_eos``), so both stacks do the same work; short, so that on two CPU
  cores the run is about the prompts (what the hierarchy changes), not decode;
- the device pool holds ``working set / --pressure`` tokens (default 4), where
  the working set is the distinct tokens of every chat's final history (the
  system prompt once): radix-only must evict histories between turns and
  recompute them; the hierarchy keeps them in host memory (``--hicache-ratio``
  times the pool) and loads them back.

Prints one JSON object on its last line: per stack TTFT p50 / p99 (submission
to the first streamed token), end-to-end p50, throughput (requests and output
tokens per wall second), prefill tokens computed, cached tokens per tier (the
replies' ``cached_tokens_details``); for the hierarchy, memsvc's ``hicache``
counters, the bytes moved per host-hit token and the copy bandwidth its loads
and writes reached against a raw memcpy measured in the same run
(``load_vs_memcpy``, ``write_vs_memcpy``); ``agreement`` per pair of stacks
(replies differing, and per chat the first turn that did); then
``ttft_p50_speedup`` (radix-only p50 / hierarchy p50), ``throughput_ratio``
(hierarchy / radix-only requests per second) and ``outputs_identical`` (every
reply token for token; exits non-zero if not, or if a service left shared
memory behind). ``--stacks hicache,radix,radix_ref`` adds a radix-only stack
whose pool holds the whole working set (nothing evicted or recomputed): where
the two differ, it says which one moved. Run with the repository on
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from hicache_workload import Chat, Turn, Workload  # bench/, on the path as the script's folder

from kvstack.model.paths import resolve_model_path
from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateResult

PAGE_SIZE = 16
MAX_RUNNING_REQUESTS = 64
REQUEST_TIMEOUT_S = 600.0
# radix_ref: radix-only with a pool that holds the whole working set (nothing is evicted,
# so nothing recomputed): which of the two a difference between them comes from.
STACKS = ("hicache", "radix", "radix_ref")

# -- serving ------------------------------------------------------------------------------


async def run_chat(
    client: AsyncGenerateClient, chat: Chat, output_len: int, end_of_turn: list[int]
) -> None:
    """The chat's turns one after another; each reply joins the history, token for token."""
    sampling = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
    for index, user_ids in enumerate(chat.user_turns):
        prompt = chat.history + user_ids
        start = time.perf_counter()
        first: float | None = None
        result: GenerateResult | None = None
        async for item in client.stream(prompt, rid=f"{chat.name}-t{index}", sampling=sampling):
            if isinstance(item, Chunk) and first is None and item.token_ids:
                first = time.perf_counter()
            elif isinstance(item, GenerateResult):
                result = item
        end = time.perf_counter()
        if result is None or result.finish_reason.get("type") == "abort":
            raise RuntimeError(f"{chat.name} turn {index} failed: {result and result.meta_info}")
        chat.turns.append(
            Turn((first or end) - start, end - start, result.output_ids, result.meta_info)
        )
        chat.history = prompt + result.output_ids + end_of_turn


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


STAT_KEYS = (
    "prefill_tokens",
    "generated_tokens",
    "forward_passes",
    "retracted_reqs",
    "prefill_s",
    "decode_s",
)


async def serve_round(
    client: AsyncGenerateClient, chats: list[Chat], output_len: int, end_of_turn: list[int]
) -> dict[str, Any]:
    before = (await client.info())["stats"]
    start = time.perf_counter()
    await asyncio.gather(*(run_chat(client, chat, output_len, end_of_turn) for chat in chats))
    wall_s = time.perf_counter() - start
    after = (await client.info())["stats"]
    return {"wall_s": wall_s, **{k: after[k] - before[k] for k in STAT_KEYS if k in after}}


def summarize(rounds: list[dict[str, Any]], turns: list[Turn]) -> dict[str, Any]:
    wall_s = sum(r["wall_s"] for r in rounds)
    ttft = [t.ttft_s for t in turns]
    e2e = [t.e2e_s for t in turns]
    tiers: dict[str, int] = {}
    for t in turns:
        for tier, count in (t.meta_info.get("cached_tokens_details") or {}).items():
            if isinstance(count, int):
                tiers[tier] = tiers.get(tier, 0) + count
    return {
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "e2e_p50_s": round(statistics.median(e2e), 4),
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(turns) / wall_s, 3),
        "output_tokens_per_s": round(sum(len(t.output_ids) for t in turns) / wall_s, 2),
        "cached_tokens": sum(t.meta_info.get("cached_tokens", 0) for t in turns),
        "cached_tokens_by_tier": tiers,
        **{k: sum(r.get(k, 0) for r in rounds) for k in STAT_KEYS},
    }


def measure_memcpy(nbytes: int, repeats: int = 5) -> float:
    """Best-of GB/s of one numpy copy of ``nbytes`` (the CPU backend's copy ceiling)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def hicache_stats(address: str) -> dict[str, Any]:
    with MemClient(address, name="bench") as client:
        stats = client.stats()
    return stats.get("hicache") or {}


def _numbers(stats: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """``stats`` flattened to its numbers (``hit_tokens.host`` ...)."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out |= _numbers(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = value
    return out


def copy_figures(
    before: dict[str, Any], after: dict[str, Any], bytes_per_token: int
) -> dict[str, Any]:
    """What the hierarchy moved (memsvc's ``hicache`` stats over the run), per token that
    hit the host or disk tier, and how fast its loads and host writes went."""
    old, new = _numbers(before), _numbers(after)
    delta = {k: round(v - old.get(k, 0), 6) for k, v in new.items()}
    load_bytes = delta.get("load_bytes", 0)
    write_bytes = delta.get("backup_bytes", 0)
    hit_tokens = delta.get("hit_tokens.host", 0) + delta.get("hit_tokens.storage", 0)
    out: dict[str, Any] = {"counters": delta, "kv_bytes_per_token": bytes_per_token}
    per_hit = (load_bytes + write_bytes) / hit_tokens if hit_tokens else None
    out["bytes_moved_per_hit_token"] = round(per_hit, 1) if per_hit else None
    out["load_bytes_per_hit_token"] = round(load_bytes / hit_tokens, 1) if hit_tokens else None
    for kind, prefix in (("load", "load"), ("write", "backup")):
        seconds = delta.get(f"{prefix}_seconds", 0.0)
        nbytes = delta.get(f"{prefix}_bytes", 0)
        out[f"{kind}_gb_per_s"] = round(nbytes / seconds / 1e9, 3) if seconds > 0 else None
    return out


async def serve(
    addresses: dict[str, str], workload: Workload, args: argparse.Namespace
) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in addresses}
    turns: dict[str, list[Turn]] = {name: [] for name in addresses}
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name in addresses}  # [chat][turn]
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            name: await stack.enter_async_context(
                AsyncGenerateClient(address, timeout_s=REQUEST_TIMEOUT_S)
            )
            for name, address in addresses.items()
        }
        for name, client in clients.items():
            await client.generate(
                workload.system_ids[:8], rid=f"warmup-{name}", sampling={"max_new_tokens": 2}
            )
        order = list(clients)
        for index in range(args.rounds):
            for name in order[index % len(order) :] + order[: index % len(order)]:
                chats = workload.chats(index)
                figures = await serve_round(
                    clients[name], chats, args.output_len, workload.end_of_turn
                )
                rounds[name].append(figures)
                turns[name] += [t for c in chats for t in c.turns]
                outputs[name] += [[t.output_ids for t in c.turns] for c in chats]
                print(
                    f"round {index} {name}: {figures['wall_s']:.1f}s", file=sys.stderr, flush=True
                )
    out: dict[str, Any] = {name: summarize(rounds[name], turns[name]) for name in addresses}
    names = list(addresses)
    out["agreement"] = {
        f"{a}_vs_{b}": compare(outputs[a], outputs[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    out["outputs_identical"] = all(v["replies_differing"] == 0 for v in out["agreement"].values())
    return out


def compare(a: list[list[list[int]]], b: list[list[list[int]]]) -> dict[str, Any]:
    """Replies that differ, and per chat the first turn that did (a later turn's prompt
    holds the earlier replies, so one differing token changes every turn after it)."""
    first = []
    for chat_a, chat_b in zip(a, b, strict=True):
        turn = next(
            (t for t, (x, y) in enumerate(zip(chat_a, chat_b, strict=True)) if x != y), None
        )
        if turn is not None:
            first.append(turn)
    replies = sum(x != y for ca, cb in zip(a, b, strict=True) for x, y in zip(ca, cb, strict=True))
    return {"replies_differing": replies, "chats_differing": len(first), "first_turns": first}


def pool_args(num_pages: int, max_context_len: int) -> list[str]:
    return [
        "--page-size", str(PAGE_SIZE),
        "--num-pages", str(num_pages),
        "--max-running-requests", str(MAX_RUNNING_REQUESTS),
        "--max-context-len", str(max_context_len),
    ]  # fmt: skip


def hicache_args(args: argparse.Namespace, tmp: str) -> list[str]:
    flags = [
        "--enable-hierarchical-cache",
        "--hicache-ratio", str(args.hicache_ratio),
        "--hicache-write-policy", args.write_policy,
    ]  # fmt: skip
    if args.storage_dir is not None:
        directory = args.storage_dir or str(Path(tmp) / "hicache-disk")
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-dir", directory]
    return flags


def run(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = resolve_model_path(args.model_path)
    workload = Workload(checkpoint, args)
    working_set, longest = workload.working_set()
    # At least the longest turn (history and reply) must fit the device pool.
    num_pages = max(int(working_set / args.pressure) // PAGE_SIZE, -(-longest // PAGE_SIZE) + 1)
    max_context_len = -(-(longest + 64) // 256) * 256
    scheduler = [
        "--schedule-conservativeness", str(args.schedule_conservativeness),
        "--retract-mode", args.retract_mode,
    ]  # fmt: skip
    memcpy_gb_s = measure_memcpy(64 << 20)
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
        result = asyncio.run(serve({n: s[2].address for n, s in stacks.items()}, workload, args))
        if "hicache" in stacks:
            hc_after = hicache_stats(stacks["hicache"][0].address)
            result["hicache"]["copies"] = copy_figures(hc_before, hc_after, bytes_per_token)
        for mem, _, _ in stacks.values():
            with MemClient(mem.address, name="bench") as client:
                client.check(idle=True)
        leaked = list(launcher.leaked_segments)
    # Measured before and after the stacks ran (the best of both): the machine's ceiling.
    memcpy_gb_s = max(memcpy_gb_s, measure_memcpy(64 << 20))
    out: dict[str, Any] = {
        "workload": {
            "model": str(checkpoint),
            "seed": args.seed,
            "rounds": args.rounds,
            "conversations": args.conversations,
            "turns": args.turns,
            "system_tokens": len(workload.system_ids),
            "user_tokens_per_turn": args.user_len,
            "output_tokens_per_turn": args.output_len,
            "working_set_tokens": working_set,
            "longest_history_tokens": longest,
            "device_pool_tokens": num_pages * PAGE_SIZE,
            "working_set_over_pool": round(working_set / (num_pages * PAGE_SIZE), 2),
            "page_size": PAGE_SIZE,
            "hicache_ratio": args.hicache_ratio,
            "write_policy": args.write_policy,
            "retract_mode": args.retract_mode,
            "disk_tier": args.storage_dir is not None,
        },
        **result,
        "memcpy_gb_per_s": round(memcpy_gb_s, 3),
        "leaked_segments": leaked,
    }
    if "hicache" in out and "copies" in out["hicache"]:
        copies = out["hicache"]["copies"]
        for kind in ("load", "write"):
            gb_s = copies.get(f"{kind}_gb_per_s")
            copies[f"{kind}_vs_memcpy"] = round(gb_s / memcpy_gb_s, 3) if gb_s else None
    if "hicache" in out and "radix" in out:
        out["ttft_p50_speedup"] = round(
            out["radix"]["ttft_p50_s"] / out["hicache"]["ttft_p50_s"], 3
        )
        out["ttft_p99_speedup"] = round(
            out["radix"]["ttft_p99_s"] / out["hicache"]["ttft_p99_s"], 3
        )
        out["throughput_ratio"] = round(
            out["hicache"]["requests_per_s"] / out["radix"]["requests_per_s"], 3
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default="smollm2", help="checkpoint folder, or smollm2 / tiny"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=256, help="system prompt tokens")
    parser.add_argument("--user-len", type=int, default=128, help="new user tokens per turn")
    parser.add_argument("--output-len", type=int, default=4, help="reply tokens per turn")
    parser.add_argument("--pressure", type=float, default=4.0, help="working set / device pool")
    parser.add_argument("--hicache-ratio", type=float, default=6.0, help="host tier / device pool")
    parser.add_argument(
        "--write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
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
        help="both stacks' scheduler --retract-mode (offload / auto: with the hierarchy, "
        "victims go into the tree's host tier)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--stacks",
        type=lambda text: text.split(","),
        default=list(STACKS[:2]),
        help="which stacks to run, in launch order: hicache, radix (the two compared) and "
        "radix_ref (radix-only on a pool that holds the whole working set)",
    )
    args = parser.parse_args(argv)
    if not args.stacks or any(s not in STACKS for s in args.stacks):
        parser.error(f"--stacks names some of {STACKS}")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    result = run(args)
    print(f"took {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(json.dumps(result))
    if result["leaked_segments"] or not result["outputs_identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
