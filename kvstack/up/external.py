"""Run a program that is not kvstack's (SMG, ``mooncake_master``) as a supervised process.

The supervisor knows a process is serving by its ready file; SMG and the Mooncake
master write none. This wrapper starts the program as its child, waits until it
answers (``--wait tcp://HOST:PORT``: it accepts a connection; ``--wait
http://HOST:PORT/PATH``: it answers 200), then writes ``--ready-file``
(``{address, pid, child_pid}``). A SIGTERM or SIGINT is passed on to the program,
which stops as it does; the wrapper then exits with the program's code (128 + N
when a signal N ended it), and exits at once, with it, when the program dies on
its own. The program dies with the wrapper even if the wrapper is SIGKILLed
(``PR_SET_PDEATHSIG``), and the wrapper with the supervisor (:mod:`memsvc.lifeline`)::

    python -m kvstack.up.external --ready-file F --address A --wait URL -- PROGRAM ARGS...
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from memsvc.cli import write_ready_file
from memsvc.lifeline import PR_SET_PDEATHSIG, die_with_parent

_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork


def _die_with_wrapper() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether the program at ``url`` answers (see the module docstring)."""
    parts = urlsplit(url)
    if parts.scheme == "tcp":
        try:
            socket.create_connection((parts.hostname, parts.port), timeout_s).close()
        except OSError:
            return False
        return True
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, ValueError, urllib.error.HTTPError):
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvstack.up.external",
        description="Run a program under kvstack's supervisor: a ready file once it answers.",
    )
    parser.add_argument("--ready-file", required=True, help="written once the program answers")
    parser.add_argument("--address", required=True, help="the address the ready file names")
    parser.add_argument(
        "--wait", required=True, help="tcp://HOST:PORT or http://HOST:PORT/PATH to wait for"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("kvstack.up.external: no program given", file=sys.stderr)
        return 2
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # none between here and the child's start
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_wrapper)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    ready = False
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = child.wait(0.1 if not ready else 1.0)
            break
        if not ready and not stopping and answers(args.wait):
            write_ready_file(args.ready_file, args.address, child_pid=child.pid)
            ready = True
    if ready:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.ready_file)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
