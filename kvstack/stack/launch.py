"""Start kvstack services as child processes and always reap them.

Each service is ``python -m MODULE --listen ADDRESS --ready-file FILE ...``;
it is up once it has written its ready file (which holds its address, pid and
epoch). :class:`Launcher` stops everything it started, last first, on exit:
SIGTERM, then SIGKILL after a grace period, so no process or shared-memory
segment outlives it: a kvstack segment a stopped service left is unlinked, and
its name kept in :attr:`Service.leaked_segments` (and
:attr:`Launcher.leaked_segments`) for the caller to report. A service also
dies with the process that started it, even one SIGKILLed (it gets SIGTERM and
shuts down cleanly: :mod:`memsvc.lifeline`).

A service that exits before it is ready, or is not ready by its deadline
(:data:`READY_TIMEOUT_S`; model_svc's grows with its checkpoint,
:func:`model_ready_timeout`), is a :class:`LaunchError` that says which, with
the end of its log.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstack.stack.model_pool import pool_layout_args, worker_threads
from memsvc.core.backends.shm import SHM_DIR, list_segments, segment_owner_pid
from memsvc.curve import KeyFolder
from memsvc.lifeline import child_env
from memsvc.transfer_backend import TransferBackend

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


def start_service(
    workdir: Path,
    module: str,
    *args: str,
    name: str | None = None,
    address: str | None = None,
    timeout: float = READY_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> Service:
    """``python -m module --listen ADDRESS --ready-file F *args``, returned once it serves.

    Raises :class:`LaunchError` if it exits first, or is not serving after ``timeout``
    seconds (then it is killed); either way its leftover segments are unlinked.
    """
    starting = spawn_service(
        workdir, module, *args, name=name, address=address, timeout=timeout, env=env
    )
    return await_service(starting)


class Launcher:
    """Starts services in ``workdir``; ``with Launcher(dir) as up: up.start(...)``.

    ``stop_timeout``: seconds each service gets after SIGTERM before SIGKILL.
    ``curve``: every service it starts serves and connects with these keys
    (CURVE on every socket); its clients need ``curve.client_keys()``.
    ``ready_timeout``: seconds each service may take to start (``--ready-timeout``);
    None: :func:`start_service`'s default, model_svc's grown with its checkpoint.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        stop_timeout: float = 30,
        curve: KeyFolder | None = None,
        ready_timeout: float | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.stop_timeout = stop_timeout
        self.curve = curve
        self.ready_timeout = ready_timeout
        self.services: list[Service] = []
        # Spawned by :meth:`spawn`, not yet awaited: killed by :meth:`stop_all`.
        self.starting: list[Starting] = []
        # Every segment a service stopped by :meth:`stop_all` left (unlinked).
        self.leaked_segments: list[str] = []

    def start(self, module: str, *args: str, **kwargs: Any) -> Service:
        return self.await_started(self.spawn(module, *args, **kwargs))

    def spawn(self, module: str, *args: str, **kwargs: Any) -> Starting:
        """Start a service without waiting for it; :meth:`await_started` does."""
        if self.curve is not None:  # every kvstack service takes the four flags
            args = (*args, *self.curve.service_args())
        if self.ready_timeout is not None:
            kwargs["timeout"] = self.ready_timeout
        starting = spawn_service(self.workdir, module, *args, **kwargs)
        self.starting.append(starting)
        return starting

    def await_started(self, starting: Starting) -> Service:
        """``starting`` once it serves (:func:`await_service`); it then stops with the rest."""
        try:
            service = await_service(starting)
        finally:
            self.starting.remove(starting)
        self.services.append(service)
        return service

    def start_normal_stack(
        self,
        checkpoint: str | Path,
        pool: list[str],
        scheduler: list[str] = (),
        *,
        model: Sequence[str] = (),
        suffix: str = "",
        env: dict[str, str] | None = None,
        log_level: str | None = None,
    ) -> tuple[Service, Service, Service]:
        """memsvc + model_svc + scheduler_svc in normal mode, wired together.

        memsvc's layout comes from the checkpoint (``pool`` may repeat it, not
        contradict it). ``model``: extra model_svc flags (``--device cuda``
        with a cuda pool; ``--threads N``, by default every usable core).
        ``log_level``, if given, is passed to each as ``--log-level``.
        """
        logging = ["--log-level", log_level] if log_level else []
        layout = pool_layout_args(checkpoint, pool)
        mem_starting = self.spawn("memsvc", *layout, *pool, *logging, name=f"memsvc{suffix}")
        model_starting = self.spawn_model(mem_starting, checkpoint, 1, model, logging, suffix)
        mem = self.await_started(mem_starting)
        model = self.await_started(model_starting)
        sched = self.start(
            "scheduler_svc",
            "--memsvc",
            mem.address,
            "--worker",
            model.address,
            *scheduler,
            *logging,
            name=f"scheduler_svc{suffix}",
            env=env,
        )
        return mem, model, sched

    def spawn_model(
        self,
        mem: Starting,
        checkpoint: str | Path,
        num_workers: int,
        model: Sequence[str],
        logging: list[str],
        suffix: str,
    ) -> Starting:
        """model_svc for memsvc ``mem``, spawned while ``mem`` starts: it imports torch and
        loads the model meanwhile, and connects once ``mem`` has written its ready file."""
        return self.spawn(
            "model_svc",
            "--memsvc",
            mem.address,
            "--memsvc-ready-file",
            str(mem.ready),
            "--checkpoint",
            str(checkpoint),
            "--threads",
            str(worker_threads(num_workers)),
            *model,
            *logging,
            name=f"model_svc{suffix}",
            timeout=model_ready_timeout(checkpoint),
        )

    def start_pd_stack(
        self,
        checkpoint: str | Path,
        pool: list[str],
        scheduler: list[str] = (),
        *,
        decode_pool: list[str] | None = None,
        decode_scheduler: list[str] = (),
        migrate_to_pool: list[str] | None = None,
        migrate: bool = True,
        transfer_backend: TransferBackend | str = TransferBackend.AUTO,
        transfer_timeout: float = 5.0,
        model: Sequence[str] = (),
        router: Sequence[str] = (),
        suffix: str = "",
        log_level: str | None = None,
    ) -> dict[str, Service]:
        """A prefill node, a decode node and the router, wired together; returns them by name.

        ``pool`` / ``scheduler`` apply to both nodes; ``decode_pool`` /
        ``decode_scheduler`` add to (and win over) them on the decode node.
        ``migrate_to_pool``: a second decode node (``memsvc-d2``, ``model_svc-d2``,
        ``scheduler-d2``; ``pool`` and these flags), which the first one moves its
        retracted requests to (``--migrate-to``; not with ``migrate=False``: the
        same nodes, none moved); the router does not send it any.
        Each memsvc's layout comes from the checkpoint; the workers split
        the usable cores (``model`` may set ``--threads``). ``router``: extra router flags.
        """
        logging = ["--log-level", log_level] if log_level else []
        transfer = [
            "--transfer-backend",
            str(transfer_backend),
            "--transfer-timeout",
            str(transfer_timeout),
        ]
        listen = f"ipc://{self.workdir}/transfer{suffix}.sock"
        nodes = [
            ("d", "decode", [*pool, *(decode_pool or [])], ["--transfer-listen", listen]),
            ("p", "prefill", pool, ["--transfer-peer", listen]),
        ]
        decode_scheduler = list(decode_scheduler)
        if migrate_to_pool is not None:
            listen2 = f"ipc://{self.workdir}/transfer-d2{suffix}.sock"
            nodes.insert(
                0, ("d2", "decode", [*pool, *migrate_to_pool], ["--transfer-listen", listen2])
            )
        up: dict[str, Service] = {}
        for node, role, node_pool, extra in nodes:
            mem_starting = self.spawn(
                "memsvc",
                *pool_layout_args(checkpoint, node_pool),
                *node_pool,
                "--pd-role",
                role,
                *transfer,
                *extra,
                *logging,
                name=f"memsvc-{node}{suffix}",
            )
            model_starting = self.spawn_model(
                mem_starting, checkpoint, len(nodes), model, logging, f"-{node}{suffix}"
            )
            up[f"memsvc-{node}"] = self.await_started(mem_starting)
            up[f"model_svc-{node}"] = self.await_started(model_starting)
            node_scheduler = [*scheduler, *decode_scheduler] if node == "d" else list(scheduler)
            if node == "d" and "scheduler-d2" in up and migrate:
                node_scheduler += ["--migrate-to", up["scheduler-d2"].address]
            up[f"scheduler-{node}"] = self.start(
                "scheduler_svc",
                "--mode",
                role,
                "--memsvc",
                up[f"memsvc-{node}"].address,
                "--worker",
                up[f"model_svc-{node}"].address,
                *node_scheduler,
                *logging,
                name=f"scheduler-{node}{suffix}",
            )
        up["router"] = self.start(
            "scheduler_svc.pd.router",
            "--prefill",
            up["scheduler-p"].address,
            "--decode",
            up["scheduler-d"].address,
            *router,
            *logging,
            name=f"router{suffix}",
        )
        return up

    def stop_all(self) -> None:
        """Stop every service, last started first; each one even if stopping another raised."""
        services, self.services = self.services, []
        starting, self.starting = self.starting, []
        with contextlib.ExitStack() as stack:
            for spawned in starting:  # a start given up: nothing to stop cleanly
                stack.callback(spawned.kill)
            for service in services:  # unwound last first
                stack.callback(self._stop, service)

    def _stop(self, service: Service) -> None:
        service.stop(timeout=self.stop_timeout)
        self.leaked_segments += service.leaked_segments

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
