"""KV outlives its users (issue 32), measured: scheduler kills, moves, a drain, skewed load.

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

``--parts pdkill``: the same on a supervised PD stack (both nodes roomy, the
clients on the router), the decode scheduler SIGKILLed. Its successor adopts
memsvc-D's session, the router asks it which requests it adopted and prefills
only the others again. ``pd_kill_reprefilled_tokens``: the prompt tokens the
prefill node computed again (its ``prefill_tokens`` over the faulted run, less
each prompt once) plus the KV tokens memsvc-D freed; ``pd_kill_reattached`` /
``pd_kill_redrives``: the router's requests reattached with their KV / started
over; before PD adoption every live request was started over and prefilled again.

The move and skew parts (``--parts move,skew``) run on PD stacks:
:mod:`kv_outlives_pd`'s docstring says what they measure.

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

from kv_outlives_pd import measure_moves, measure_skew  # bench/, the script's folder
from kv_outlives_run import PAGE_SIZE, QUICK_TOKEN_RANGE, TOKEN_RANGE, Run, next_token_s

from kvstack.model.paths import resolve_model_path
from kvstack.stack.spec import StackOptions, normal_stack, pd_stack
from kvstack.up.supervisor import RestartPolicy, Supervisor
from memsvc.client import MemClient
from scheduler_svc.client import GenerateClient


def pool_args(requests: int, prompt_len: int, max_new: int) -> list[str]:
    per_request = -(-(prompt_len + max_new + PAGE_SIZE) // PAGE_SIZE) + 1
    return [
        "--page-size", str(PAGE_SIZE),
        "--num-pages", str(2 * requests * per_request),  # roomy: no retract
        "--max-running-requests", str(max(requests, 4)),
        "--max-context-len", str(prompt_len + max_new + PAGE_SIZE),
    ]  # fmt: skip


# The stack of each kill part: its processes, where clients send, the scheduler killed
# and the memsvc processes checked idle afterwards.
KILL_STACKS = {
    "normal": (normal_stack, "scheduler_svc", "scheduler_svc", ("memsvc",)),
    "pd": (pd_stack, "router", "scheduler-d", ("memsvc-d", "memsvc-p")),
}


def kill_run(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The reference run, then the same run with the scheduler SIGKILLed mid-decode, on a
    supervised ``mode`` stack; what the two runs say (see the module docstring)."""
    build, front, target, memsvcs = KILL_STACKS[mode]
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
    supervisor = Supervisor(build(run_dir, options), run_dir, policy=policy)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, run_dir, ignore_errors=True)
        cleanup.enter_context(supervisor.running())
        address = supervisor.address(front)
        reference = Run(prompts, args.max_new, "ref")
        started = time.monotonic()
        asyncio.run(reference.serve(address))
        reference_s = time.monotonic() - started
        before = flushed_info(address)
        killed: dict[str, float] = {}

        async def kill(run: Run) -> None:
            while min(len(t) for t in run.tokens.values()) < args.kill_after:
                await asyncio.sleep(0.01)
            pid = supervisor.pid(target)
            killed["at"] = time.monotonic()
            killed["arrivals"] = len(run.arrivals)
            os.kill(pid, signal.SIGKILL)

        faulted = Run(prompts, args.max_new, "kill")
        asyncio.run(faulted.serve(address, kill))
        info = front_info(address)
        held = 0
        for name in memsvcs:
            with MemClient(supervisor.address(name), timeout_s=10) as mem:
                mem.check(idle=True)
                held += int(mem.stats()["held"])
    return {
        "reference_s": round(reference_s, 2),
        "before": before,
        "info": info,
        "to_next_token_s": next_token_s(faulted.arrivals[killed["arrivals"] :], killed["at"]),
        "errors": faulted.errors,
        "identical": faulted.tokens == reference.tokens and not faulted.errors,
        "held": held,
        "prompt_tokens": sum(map(len, prompts)),
    }


def front_info(address: str) -> dict[str, Any]:
    with GenerateClient(address, timeout_s=30, resubmits=0) as client:
        return client.info()


def flushed_info(address: str) -> dict[str, Any]:
    """The front's info once the prefix cache (every node's) is empty: the faulted run
    prefills each prompt in full, as the reference did."""
    with GenerateClient(address, timeout_s=30, resubmits=0) as client:
        deadline = time.monotonic() + 60
        while not client.flush_cache()[0]:  # refused while the last requests end
            if time.monotonic() > deadline:
                raise RuntimeError("the prefix cache could not be flushed within 60 s")
            time.sleep(0.2)
        return client.info()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 in normal mode (the module docstring)."""
    run = kill_run(args, "normal")
    info = run["info"]
    recovery = info["recovery"]
    prefilled = int(info["stats"]["prefill_tokens"])
    return {
        "model": str(resolve_model_path(args.model_path)),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new,
        "kill_after_tokens": args.kill_after,
        "reference_s": run["reference_s"],
        "scheduler_kill_reprefilled_tokens": prefilled + int(recovery["reprefilled_tokens"]),
        "scheduler_kill_prefilled_after_kill": prefilled,
        "scheduler_kill_freed_kv_tokens": int(recovery["reprefilled_tokens"]),
        "scheduler_kill_kv_tokens_at_kill": int(recovery["adopted_kv_tokens"])
        + int(recovery["reprefilled_tokens"]),
        "scheduler_kill_adopted_reqs": int(recovery["adopted_reqs"]),
        "scheduler_kill_discarded_step_tokens": int(recovery["discarded_step_tokens"]),
        "scheduler_kill_to_next_token_s": run["to_next_token_s"],
        "scheduler_kill_errors": run["errors"],
        "outputs_identical": run["identical"],
        "idle_held_tokens": run["held"],
    }


def measure_pd_kill(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 in PD mode, the decode scheduler killed (the module docstring)."""
    run = kill_run(args, "pd")
    before, info = run["before"], run["info"]
    recovery = info["recovery"]
    prefill_tokens = int(info["prefill"]["stats"]["prefill_tokens"]) - int(
        before["prefill"]["stats"]["prefill_tokens"]
    )
    again = prefill_tokens - run["prompt_tokens"]  # each prompt once is the run itself
    router = {k: info["router"][k] - before["router"].get(k, 0) for k in ("reattached", "redrives")}
    return {
        "pd_kill_reference_s": run["reference_s"],
        "pd_kill_reprefilled_tokens": again + int(recovery["reprefilled_tokens"]),
        "pd_kill_prompt_tokens_prefilled_again": again,
        "pd_kill_freed_kv_tokens": int(recovery["reprefilled_tokens"]),
        "pd_kill_adopted_reqs": int(recovery["adopted_reqs"]),
        "pd_kill_adopted_kv_tokens": int(recovery["adopted_kv_tokens"]),
        "pd_kill_discarded_step_tokens": int(recovery["discarded_step_tokens"]),
        "pd_kill_reattached": router["reattached"],
        "pd_kill_redrives": router["redrives"],
        "pd_kill_to_next_token_s": run["to_next_token_s"],
        "pd_kill_errors": run["errors"],
        "pd_kill_outputs_identical": run["identical"],
        "pd_kill_idle_held_tokens": run["held"],
    }


# -- a request moved to another decode node, and a node drained (parts 2 and 3) ----------


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
        default="kill,pdkill,move,skew",
        help="kill (part 1), pdkill (part 1 in PD mode: the decode scheduler), move "
        "(parts 2 and 3: a request moved to another decode "
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
    if "pdkill" in parts:
        result.update(measure_pd_kill(args))
    if "move" in parts:
        result.update(measure_moves(args))
    if "skew" in parts:
        result.update(measure_skew(args))
    identical = [result[k] for k in result if k.endswith("outputs_identical")]
    result["outputs_identical"] = all(identical)
    print(json.dumps(result))
    held = result.get("idle_held_tokens", 0) + result.get("pd_kill_idle_held_tokens", 0)
    return 0 if result["outputs_identical"] and held == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
