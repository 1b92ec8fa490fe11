"""``kvstack drain ADDRESS``: move every request off a decode node, with its KV, then stop it.

The node is a PD decode scheduler started with ``--migrate-to`` (another decode
node). Draining is its SIGTERM (scheduler_svc.pd.migrate): it takes no new
request, sends each running one to the peer straight from its pool pages (and
each retracted one from its memsvc's host store) as the peer has room, and
exits once all moved: the PD router follows each to the peer (a client that
does not follow moves is relayed to until its request ended there). This
command finds the node's process from its ``info`` (so it must run on the
node's host, as a user allowed to signal it: the operating system decides who
may drain, not the socket), sends the signal, and reports the node's queues
until it is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvstack.up.cli import pid_alive
from scheduler_svc.client import GenerateClient

POLL_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Move every request off a PD decode node started with --migrate-to, with its KV, "
        "to its peer, then stop it (its SIGTERM; run this on the node's host)."
    )
    parser.add_argument("address", help="the decode node's scheduler address (its --listen)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the node to stop"
    )


def node_info(address: str) -> dict[str, Any] | None:
    """The scheduler's info; None once it no longer answers."""
    try:
        with GenerateClient(address, timeout_s=5) as client:
            return client.info()
    except Exception:
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (an exited one its parent has not reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        return pid_alive(pid)


def run(args: argparse.Namespace) -> int:
    info = node_info(args.address)
    if info is None:
        print(f"kvstack drain: no scheduler answers at {args.address}", file=sys.stderr)
        return 2
    if info.get("mode") != "decode" or not info.get("migrate_to"):
        print(
            f"kvstack drain: {args.address} is not a decode node with --migrate-to "
            f"(mode {info.get('mode')}): its requests have nowhere to go",
            file=sys.stderr,
        )
        return 2
    pid = int(info["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        print(f"kvstack drain: not allowed to signal process {pid}", file=sys.stderr)
        return 2
    print(f"draining {args.address} (pid {pid}) onto {info['migrate_to']}", flush=True)
    deadline = time.monotonic() + args.timeout
    while alive(pid):
        if time.monotonic() > deadline:
            print(f"kvstack drain: {pid} still runs after {args.timeout:g}s", file=sys.stderr)
            return 1
        now = node_info(args.address)
        if now is not None:
            print(f"  queues {now.get('queues')}", flush=True)
        time.sleep(POLL_S)
    print(f"{args.address} drained and stopped", flush=True)
    return 0
