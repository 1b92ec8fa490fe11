"""KV outlives its users (issue 32), measured: the scheduler-kill part.

A supervised normal-mode stack (memsvc, model_svc, scheduler_svc under
``kvstack.up``'s :class:`Supervisor`, the scheduler's memsvc session id in its
session file) on SmolLM2-135M-Instruct (``--model-path``), on a pool roomy
enough that nothing is retracted. ``--requests`` requests of ``--prompt-len``
random prompt tokens each stream ``--max-new`` greedy tokens; once every one of
them has streamed ``--kill-after`` tokens (all running, mid-decode) the
scheduler is SIGKILLed. The supervisor restarts it; it adopts its predecessor's
memsvc session (scheduler_svc.adopt) and the clients re-submit under the same
rids. Measured:

- ``scheduler_kill_reprefilled_tokens``: prompt/output tokens the restarted
  scheduler prefilled (its engine's ``prefill_tokens``: on this roomy pool
  nothing else prefills after the kill) plus the KV tokens of the dead
  scheduler's requests memsvc freed (``recovery.reprefilled_tokens``). Before
  adoption every request was prefilled again: the figure to compare with is
  ``scheduler_kill_kv_tokens_at_kill``, the KV the dead scheduler's requests
  held (what was adopted plus what was freed);
- ``scheduler_kill_to_next_token_s``: from the kill to the first token the
  restarted scheduler sends (the restart, the adoption, the re-submission; the
  dead one's last chunks, still in flight, are told apart as a burst);
- ``outputs_identical``: every request's tokens equal a fault-free run's.

The move part (``--parts move``): a PD stack whose decode node has a peer
(``--migrate-to``); one ``--migrate-len``-token request (4,096) streams, then
streams again with the decode node drained (SIGTERM) mid-decode, so that it
moves to the peer with its KV: ``migration_bytes``, ``migration_s`` (its
stream's stall: the park, the send, the peer's preallocation and first step),
``migration_vs_reprefill`` (that over one prefill of its prompt on the prefill
node); then a node holding ``--drain-requests`` requests (16) drained the same
way: ``drain_moved_reqs``, ``drain_s`` (until it stopped: its last relayed
request's end), the tokens prefilled again (``*_reprefilled_tokens``) and
token identity with the untouched run.

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

The last line is JSON. Run with the repository on ``PYTHONPATH``; ``--quick``:
the tiny model, 4 requests of 64 tokens, a 200-token move, 4 drained, a skewed
load of 6 requests of 48 tokens and 64 new ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstack.model.paths import resolve_model_path
from kvstack.stack.launch import Launcher
from kvstack.stack.spec import StackOptions, normal_stack
from kvstack.up.supervisor import RestartPolicy, Supervisor
from memsvc.client import MemClient
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateClient, GenerateResult

PAGE_SIZE = 16
TOKEN_RANGE = (256, 8192)  # prompt tokens: ordinary BPE ids of SmolLM2's vocabulary
QUICK_TOKEN_RANGE = (3, 255)  # the tiny model's byte vocabulary


def pool_args(requests: int, prompt_len: int, max_new: int) -> list[str]:
    per_request = -(-(prompt_len + max_new + PAGE_SIZE) // PAGE_SIZE) + 1
    return [
        "--page-size", str(PAGE_SIZE),
        "--num-pages", str(2 * requests * per_request),  # roomy: no retract
        "--max-running-requests", str(max(requests, 4)),
        "--max-context-len", str(prompt_len + max_new + PAGE_SIZE),
    ]  # fmt: skip


class Run:
    """One workload over the stack: streams, when each token arrived, and an optional kill."""

    def __init__(self, prompts: list[list[int]], max_new: int, prefix: str) -> None:
        self.prompts = prompts
        self.max_new = max_new
        self.prefix = prefix
        self.tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        self.arrivals: list[float] = []
        self.errors: list[str] = []
        self.latency_s: dict[int, float] = {}  # submission to the last token
        self.ttft_s: dict[int, float] = {}

    async def one(self, client: AsyncGenerateClient, i: int) -> None:
        sampling = {"max_new_tokens": self.max_new, "temperature": 0.0, "ignore_eos": True}
        got = self.tokens[i]
        rid = f"{self.prefix}-{i}"
        started = time.monotonic()
        async for item in client.stream(self.prompts[i], rid=rid, sampling=sampling):
            if isinstance(item, Chunk):
                got += item.token_ids
                self.arrivals.append(time.monotonic())
                self.ttft_s.setdefault(i, self.arrivals[-1] - started)
            elif isinstance(item, GenerateResult):
                reason = item.finish_reason or {}
                if reason.get("type") == "abort":
                    self.errors.append(f"{i}: {reason.get('message')}")
                self.tokens[i] = list(item.output_ids)
        self.latency_s[i] = time.monotonic() - started

    async def serve(self, address: str, kill: Any = None) -> None:
        async with AsyncGenerateClient(address, timeout_s=600.0, resubmits=6) as client:
            tasks = [asyncio.create_task(self.one(client, i)) for i in range(len(self.prompts))]
            if kill is not None:
                tasks.append(asyncio.create_task(kill(self)))
            await asyncio.gather(*tasks)


def next_token_s(arrivals: list[float], killed_at: float, burst_s: float = 0.1) -> float | None:
    """Seconds from the kill to the first token the restarted scheduler sent: chunks the
    dead one had sent still arrive in a burst right after the kill, so the first
    arrival after a silence of ``burst_s`` (else the first arrival)."""
    last = killed_at
    for at in arrivals:
        if at - last >= burst_s:
            return round(at - killed_at, 3)
        last = at
    return round(arrivals[0] - killed_at, 3) if arrivals else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = resolve_model_path(args.model_path)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(*args.token_range) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    run_dir = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    options = StackOptions(
        checkpoint=str(checkpoint),
        memsvc_args=pool_args(args.requests, args.prompt_len, args.max_new),
        # a 16k-token prefill batch on two busy CPU cores may take minutes
        scheduler_args=["--worker-timeout", "900", "--recovery-timeout", "900"],
        log_level="WARNING",
    )
    policy = RestartPolicy(initial_s=0.2, max_s=3.0, stable_s=5.0, ready_timeout_s=300.0)
    supervisor = Supervisor(normal_stack(run_dir, options), run_dir, policy=policy)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
        cleanup.enter_context(supervisor.running())
        address = supervisor.address("scheduler_svc")
        reference = Run(prompts, args.max_new, "ref")
        started = time.monotonic()
        asyncio.run(reference.serve(address))
        reference_s = time.monotonic() - started
        killed: dict[str, float] = {}

        async def kill(run: Run) -> None:
            while min(len(t) for t in run.tokens.values()) < args.kill_after:
                await asyncio.sleep(0.01)
            pid = supervisor.pid("scheduler_svc")
            killed["at"] = time.monotonic()
            killed["arrivals"] = len(run.arrivals)
            os.kill(pid, signal.SIGKILL)

        faulted = Run(prompts, args.max_new, "kill")
        asyncio.run(faulted.serve(address, kill))
        after = faulted.arrivals[killed["arrivals"] :]
        with GenerateClient(address, timeout_s=30, resubmits=0) as client:
            info = client.info()
        with MemClient(supervisor.address("memsvc"), timeout_s=10) as mem:
            mem.check(idle=True)
            held = int(mem.stats()["held"])
    recovery = info["recovery"]
    prefilled = int(info["stats"]["prefill_tokens"])
    return {
        "model": str(checkpoint),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new,
        "kill_after_tokens": args.kill_after,
        "reference_s": round(reference_s, 2),
        "scheduler_kill_reprefilled_tokens": prefilled + int(recovery["reprefilled_tokens"]),
        "scheduler_kill_prefilled_after_kill": prefilled,
        "scheduler_kill_freed_kv_tokens": int(recovery["reprefilled_tokens"]),
        "scheduler_kill_kv_tokens_at_kill": int(recovery["adopted_kv_tokens"])
        + int(recovery["reprefilled_tokens"]),
        "scheduler_kill_adopted_reqs": int(recovery["adopted_reqs"]),
        "scheduler_kill_discarded_step_tokens": int(recovery["discarded_step_tokens"]),
        "scheduler_kill_to_next_token_s": next_token_s(after, killed["at"]),
        "scheduler_kill_errors": faulted.errors,
        "outputs_identical": faulted.tokens == reference.tokens and not faulted.errors,
        "idle_held_tokens": held,
    }


# -- a request moved to another decode node, and a node drained (parts 2 and 3) ----------


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
        "drain_s": drain["drain_s"],
        "drain_stall_s": drain["stall_s"],
        "drain_reprefilled_tokens": drain["reprefilled_tokens"],
        "drain_outputs_identical": drain["outputs_identical"],
        "drain_errors": drain["errors"],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 3)


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
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p99_s": percentile(latency, 0.99),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument("--migrate-len", type=int, default=4096)
    parser.add_argument("--drain-requests", type=int, default=16)
    parser.add_argument("--drain-prompt-len", type=int, default=256)
    parser.add_argument("--skew-requests", type=int, default=24)
    parser.add_argument("--skew-prompt-len", type=int, default=256)
    parser.add_argument("--skew-max-new", type=int, default=96)
    parser.add_argument(
        "--skew-pool",
        type=float,
        default=0.4,
        help="each decode node's pool, as a fraction of the skewed batch's final KV",
    )
    parser.add_argument(
        "--parts",
        default="kill,move,skew",
        help="kill (part 1), move (parts 2 and 3: a request moved to another decode "
        "node, a decode node drained), skew (part 4: one hot decode node of two, "
        "with and without moving its retracted requests to the cold one)",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    args.token_range = QUICK_TOKEN_RANGE if args.quick else TOKEN_RANGE
    if args.quick:
        args.model_path, args.requests, args.prompt_len, args.max_new = "tiny", 4, 64, 24
        args.kill_after, args.migrate_len, args.drain_requests = 4, 200, 4
        args.drain_prompt_len = 32
        args.skew_requests, args.skew_prompt_len, args.skew_max_new = 6, 48, 64
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {}
    if "kill" in parts:
        result.update(measure(args))
    if "move" in parts:
        result.update(measure_moves(args))
    if "skew" in parts:
        result.update(measure_skew(args))
    identical = [result[k] for k in result if k.endswith("outputs_identical")]
    result["outputs_identical"] = all(identical)
    print(json.dumps(result))
    return 0 if result["outputs_identical"] and result.get("idle_held_tokens", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
