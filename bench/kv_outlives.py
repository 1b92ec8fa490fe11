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
from kvstack.stack.spec import StackOptions, normal_stack
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
