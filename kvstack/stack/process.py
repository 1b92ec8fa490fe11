"""One kvstack service as a child process: spawn it, wait for its ready file, stop it.

Each service is ``python -m MODULE --listen ADDRESS --ready-file FILE ...``;
it is up once it has written its ready file (which holds its address, pid and
epoch). A service that exits before it is ready, or is not ready by its deadline
(:data:`READY_TIMEOUT_S`; model_svc's grows with its checkpoint,
:func:`model_ready_timeout`), is a :class:`LaunchError` that says which, with
the end of its log. Stopping it is SIGTERM, then SIGKILL after a grace period; a
kvstack shared-memory segment it left is unlinked and named in
:attr:`Service.leaked_segments`. A service also dies with the process that
started it, even one SIGKILLed (:mod:`memsvc.lifeline`). :mod:`kvstack.stack.launch`
starts whole stacks of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memsvc.core.backends.shm import SHM_DIR, list_segments, segment_owner_pid
from memsvc.lifeline import child_env

REPO = Path(__file__).resolve().parents[2]
# Seconds a service may take to write its ready file: generous, as a start-up on a
# loaded machine (imports, a torch start) takes many times what it does on an idle one.
READY_TIMEOUT_S = 120.0
# model_svc's deadline grows by this much per GB of checkpoint (read and converted
# on two busy cores; SmolLM2-135M's 0.5 GB adds a minute).
LOAD_S_PER_GB = 120.0
LOG_TAIL_LINES = 30


class LaunchError(RuntimeError):
    """A service exited or did not become ready in time; the message says which, and
    ends with its log's last lines."""


def model_ready_timeout(checkpoint: str | Path) -> float:
    """model_svc's ready deadline: :data:`READY_TIMEOUT_S` plus time to load ``checkpoint``."""
    folder = Path(checkpoint)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0
    return READY_TIMEOUT_S + LOAD_S_PER_GB * size / 1e9


def add_ready_timeout(group: Any) -> None:
    """``--ready-timeout``: how long ``serve`` and ``up`` give each service to start."""
    group.add_argument(
        "--ready-timeout",
        type=float,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="seconds each service may take to start (default: "
        f"{READY_TIMEOUT_S:g}, plus {LOAD_S_PER_GB:g} per GB of checkpoint, which model_svc "
        "loads)",
    )


def ready_timeout(args: argparse.Namespace, checkpoint: str | Path | None) -> float:
    """``--ready-timeout``, or its default for ``checkpoint`` (None: no model to load)."""
    given = getattr(args, "ready_timeout", None)
    if given is not None:
        return given
    return READY_TIMEOUT_S if checkpoint is None else model_ready_timeout(checkpoint)


def service_env(extra: dict[str, str] | None = None, *, die_with_parent: bool = True) -> dict:
    """A service's environment: this one, the repository importable, ``extra``; and,
    if ``die_with_parent``, what makes it exit when this process does."""
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    lifeline = child_env() if die_with_parent else {}
    return {**os.environ, "PYTHONPATH": python_path, **lifeline, **(extra or {})}


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """``"its log PATH ends:"`` and its last ``lines`` lines, or that it is empty or missing."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"no log at {path}"
    if not text.strip():
        return f"its log {path} is empty"
    return f"its log {path} ends:\n" + "\n".join(text.splitlines()[-lines:])


def exit_status(code: int) -> str:
    """``"exited with code 1"`` or ``"was killed by SIGKILL"`` (a Popen returncode)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def remove_segments(pid: int) -> list[str]:
    """Unlink the kvstack shm segments process ``pid`` (now gone) left; returns their names."""
    left = [name for name in list_segments() if segment_owner_pid(name) == pid]
    for name in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    return left


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    address: str
    info: dict[str, Any]
    log_path: Path
    # Segments the process left behind, unlinked by :meth:`stop` (a leak for the caller to report).
    leaked_segments: list[str] = field(default_factory=list)

    @property
    def epoch(self) -> str | None:
        return self.info.get("epoch")

    @property
    def metrics_port(self) -> int | None:
        return self.info.get("metrics_port")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """``sig``, then SIGKILL after ``timeout`` seconds; reaped, its leftover segments unlinked.

        Returns the exit code; the segments' names are added to :attr:`leaked_segments`.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.leaked_segments += remove_segments(self.proc.pid)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@dataclass
class Starting:
    """A service spawned by :func:`spawn_service`, not yet known to serve."""

    name: str
    proc: subprocess.Popen
    address: str
    ready: Path  # its ready file
    log_path: Path
    timeout: float
    deadline: float  # time.monotonic() by which it must be ready

    def kill(self) -> None:
        """Kill and reap it, and unlink what it left (a start that failed or was given up)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        remove_segments(self.proc.pid)


def spawn_service(
    workdir: Path,
    module: str,
    *args: str,
    name: str | None = None,
    address: str | None = None,
    timeout: float = READY_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> Starting:
    """``python -m module --listen ADDRESS --ready-file F *args``, spawned; :func:`await_service`
    waits until it serves (so several services can start at once)."""
    name = name or module
    address = address or f"ipc://{workdir}/{name}.sock"
    ready = workdir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    command = [sys.executable, "-m", module, "--listen", address, "--ready-file", str(ready), *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=service_env(env)
        )
    return Starting(name, proc, address, ready, log_path, timeout, time.monotonic() + timeout)


def await_service(starting: Starting) -> Service:
    """The :class:`Service` once ``starting`` has written its ready file.

    Raises :class:`LaunchError` if it exits first, or is not serving by its
    deadline (then it is killed); either way its leftover segments are unlinked.
    """
    proc = starting.proc
    while not starting.ready.exists():
        if proc.poll() is not None:
            what = f"{exit_status(proc.returncode)} before it was ready"
        elif time.monotonic() > starting.deadline:
            what = (
                f"was still running but not ready after {starting.timeout:.0f}s "
                f"(pid {proc.pid}; killed)"
            )
        else:
            time.sleep(0.02)
            continue
        starting.kill()
        raise LaunchError(f"{starting.name} {what}; {log_tail(starting.log_path)}")
    info = json.loads(starting.ready.read_text())
    return Service(starting.name, proc, starting.address, info, starting.log_path)


def start_service(workdir: Path, module: str, *args: str, **options: Any) -> Service:
    """``python -m module --listen ADDRESS --ready-file F *args``, returned once it serves
    (``options``: :func:`spawn_service`'s).

    Raises :class:`LaunchError` if it exits first, or is not serving after its ``timeout``
    (then it is killed); either way its leftover segments are unlinked.
    """
    return await_service(spawn_service(workdir, module, *args, **options))
