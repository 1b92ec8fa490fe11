"""``kvstack status``: each process of a supervised stack, its pid, liveness, health, restarts.

It reads the supervisor's ``state.json`` in the run directory for pids,
addresses and restart counts, and pings every process itself (memsvc: a
session heartbeat; model_svc: ``info``; scheduler_svc: ``info``) with a short
timeout, so the answer is current even if the supervisor is gone. A cluster
(``kvstack up --nodes N``) lists every node's services (``nodeI/memsvc``...,
``nodeI/http``), the Mooncake master and SMG (its ready workers). The exit
code is 0 only when the supervisor and every process are alive and healthy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstack.up.cli import pid_alive
from kvstack.up.health import check
from kvstack.up.supervisor import STATE_FILE
from memsvc.core.errors import InvalidArgumentError
from memsvc.curve import KeyFolder

EXIT_UNHEALTHY = 1
EXIT_NO_STACK = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", required=True, help="the run directory of `kvstack up`")
    parser.add_argument(
        "--timeout", type=float, default=2.0, help="seconds each health check may take"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def inspect(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    """The state file's view, with liveness and health checked now.

    A stack with CURVE on is pinged with the client keys in its ``curve_dir``.
    """
    state = json.loads((run_dir / STATE_FILE).read_text())
    curve_dir = state.get("curve_dir")
    curve = KeyFolder.existing(curve_dir).client_keys() if curve_dir else None
    supervisor_pid = state.get("supervisor_pid")
    state["supervisor_alive"] = bool(supervisor_pid) and pid_alive(supervisor_pid)
    for proc in state["processes"]:
        pid = proc.get("pid")
        proc["alive"] = bool(pid) and pid_alive(pid)
        if proc["alive"]:
            proc["healthy"], proc["health"] = check(proc["kind"], proc["address"], timeout_s, curve)
        else:
            proc["healthy"], proc["health"] = False, f"not running ({proc.get('state')})"
    state["healthy"] = state["supervisor_alive"] and all(p["healthy"] for p in state["processes"])
    return state


def render(state: dict[str, Any]) -> str:
    sup = "alive" if state["supervisor_alive"] else "NOT RUNNING"
    width = max([15, *(len(p["name"]) + 1 for p in state["processes"])])
    lines = [
        f"run dir {state['run_dir']}  mode {state['mode']}  status {state['status']}  "
        f"supervisor pid {state['supervisor_pid']} ({sup})",
        f"{'NAME':<{width}}{'PID':>8}  {'ALIVE':<6}{'RESTARTS':>8}  {'HEALTH':<8}DETAIL",
    ]
    for proc in state["processes"]:
        health = "ok" if proc["healthy"] else "BAD"
        detail = proc["health"].removeprefix("ok: ")
        lines.append(
            f"{proc['name']:<{width}}{proc['pid'] or '-':>8}  {'yes' if proc['alive'] else 'no':<6}"
            f"{proc['restarts']:>8}  {health:<8}{detail}  [{proc['address']}]"
        )
    lines.append("healthy" if state["healthy"] else "UNHEALTHY")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        state = inspect(run_dir, args.timeout)
    except InvalidArgumentError as exc:  # the stack's CURVE keys cannot be read
        print(f"kvstack status: error: {exc}", file=sys.stderr)
        return EXIT_NO_STACK
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvstack status: no supervised stack in {run_dir}: {exc}", file=sys.stderr)
        return EXIT_NO_STACK
    print(json.dumps(state) if args.json else render(state), flush=True)
    return 0 if state["healthy"] else EXIT_UNHEALTHY
