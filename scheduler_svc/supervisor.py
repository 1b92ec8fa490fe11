"""``kvstack up``: start one stack, restart what dies, stop everything cleanly.

A stack is a list of :class:`ProcessSpec` (command, address, ready file,
which health check applies), built by :func:`build_process_list` for a mode:
``normal`` is memsvc + model_svc (the bundled tiny model by default) +
scheduler_svc, wired over ``ipc://`` sockets in the run directory; ``pd`` is a
decode node and a prefill node (memsvc-d, memsvc-p, model_svc-d, model_svc-p,
scheduler-d, scheduler-p, the two memsvc linked by a transfer socket) and the
router in front. Every address is fixed by the run directory, so a restarted
process comes back where its peers (the router, the other memsvc, the
workers) reconnect by themselves; everything else is shared by the modes.

:class:`Supervisor` runs such a list (``kvstack up`` uses it; tests, the fault
harness and ``kvstack serve`` can too):

- ``start()`` starts the processes in order, each once the previous one
  serves (it wrote its ready file) and answers its health check;
- ``poll()`` (``serve()`` calls it in a loop) reaps a process that exited,
  logs ``"memsvc exited with code -9; restarting in 0.5s (restart #1)"`` and
  starts it again after an exponential backoff with a cap (a process that
  stayed up for ``stable_s`` starts over at the shortest delay). A dead
  memsvc's shared-memory segments are unlinked before its successor starts.
  Only the dead process restarts: the others reconnect to it themselves;
- ``stop()`` stops the processes last first (SIGTERM, then SIGKILL after a
  grace period) and removes their shm segments, sockets and ready files.

The state file (``state.json`` in the run directory) holds every process's
pid, address, state, health and restarts; ``kvstack status`` reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memsvc.cli import LOG_FORMAT
from scheduler_svc.launch import REPO, TINY_MODEL_POOL, remove_segments

log = logging.getLogger("kvstack.supervisor")

STATE_FILE = "state.json"
MAX_IPC_PATH = 100  # sun_path holds 108 bytes; keep a margin
PR_SET_PDEATHSIG = 1


class StackUnavailableError(Exception):
    """The asked-for stack cannot be built (a mode not available yet, a bad option)."""


class SupervisorError(RuntimeError):
    """The stack did not come up; the message says which process and shows its log."""


# -- what to run -------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessSpec:
    """One supervised process: ``command`` serves ``address`` once ``ready_file`` exists.

    ``kind`` names its health check in :data:`HEALTH_CHECKS`.
    """

    name: str
    kind: str
    command: tuple[str, ...]
    address: str
    ready_file: Path
    log_file: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_files: tuple[Path, ...] = ()  # removed when the stack stops


@dataclass
class StackOptions:
    """What a stack is made of, beyond its mode.

    ``via`` maps a process name to another address its clients connect to
    instead (the fault tests put a proxy there): ``memsvc`` / ``model_svc``
    for the scheduler's links in normal mode, ``scheduler-d`` /
    ``scheduler-p`` for the router's in PD mode. ``memsvc_args`` and
    ``scheduler_args`` go to both nodes in PD mode; the ``decode_*`` ones are
    added on the decode node only (and win). ``env`` goes to the scheduler(s).
    """

    checkpoint: str | None = None
    memsvc_args: list[str] = field(default_factory=list)
    model_args: list[str] = field(default_factory=list)
    scheduler_args: list[str] = field(default_factory=list)
    via: dict[str, str] = field(default_factory=dict)
    log_level: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    # PD mode
    decode_memsvc_args: list[str] = field(default_factory=list)
    decode_scheduler_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    transfer_backend: str = "auto"
    transfer_timeout: float | None = None


def ipc_path(run_dir: Path, name: str) -> Path:
    """``RUN_DIR/NAME.sock``, refused if too long for an ``ipc://`` socket."""
    socket_path = run_dir / f"{name}.sock"
    if len(str(socket_path)) > MAX_IPC_PATH:
        raise StackUnavailableError(
            f"run dir {run_dir} is too long for an ipc:// socket path; choose a shorter --run-dir"
        )
    return socket_path


def service_spec(
    run_dir: Path, name: str, module: str, args: list[str], *, kind: str | None = None, **kw: Any
) -> ProcessSpec:
    """``python -m module --listen ipc://RUN_DIR/NAME.sock --ready-file ... *args``."""
    socket_path = ipc_path(run_dir, name)
    ready = run_dir / f"{name}.ready"
    address = f"ipc://{socket_path}"
    command = (sys.executable, "-m", module, "--listen", address, "--ready-file", str(ready))
    return ProcessSpec(
        name, kind or name, (*command, *args), address, ready, run_dir / f"{name}.log", **kw
    )


def normal_stack(run_dir: Path, options: StackOptions) -> list[ProcessSpec]:
    """memsvc, model_svc and scheduler_svc in normal mode, in start order."""
    from model_svc.tiny import default_checkpoint  # imports torch: only when building

    logging_args = ["--log-level", options.log_level] if options.log_level else []
    checkpoint = options.checkpoint or str(default_checkpoint())
    mem = service_spec(
        run_dir, "memsvc", "memsvc", [*TINY_MODEL_POOL, *options.memsvc_args, *logging_args]
    )
    model = service_spec(
        run_dir,
        "model_svc",
        "model_svc",
        [
            "--memsvc",
            options.via.get("memsvc", mem.address),
            "--checkpoint",
            checkpoint,
            "--threads",
            "1",
            *options.model_args,
            *logging_args,
        ],
    )
    session_file = run_dir / "scheduler_svc.session"
    scheduler = service_spec(
        run_dir,
        "scheduler_svc",
        "scheduler_svc",
        [
            "--memsvc",
            options.via.get("memsvc", mem.address),
            "--worker",
            options.via.get("model_svc", model.address),
            "--memsvc-session-file",
            str(session_file),
            *options.scheduler_args,
            *logging_args,
        ],
        env=dict(options.env),
        extra_files=(session_file,),
    )
    return [mem, model, scheduler]


PD_NODES = (("d", "decode"), ("p", "prefill"))


def pd_stack(run_dir: Path, options: StackOptions) -> list[ProcessSpec]:
    """Both PD nodes and the router, in start order (the wiring of ``Launcher.start_pd_stack``).

    memsvc-d, memsvc-p, model_svc-d, model_svc-p, scheduler-d, scheduler-p,
    router: memory services first, then the workers, the schedulers (each
    with a session file, so a restarted one ends its predecessor's memsvc
    session at once, which also cancels that session's transfer rooms), and
    the router last. Stopped in the reverse order.
    """
    from model_svc.tiny import default_checkpoint  # imports torch: only when building

    logging_args = ["--log-level", options.log_level] if options.log_level else []
    checkpoint = options.checkpoint or str(default_checkpoint())
    transfer_sock = ipc_path(run_dir, "transfer")
    transfer = ["--transfer-backend", options.transfer_backend]
    if options.transfer_timeout is not None:
        transfer += ["--transfer-timeout", str(options.transfer_timeout)]
    peers = {
        "d": ["--transfer-listen", f"ipc://{transfer_sock}"],
        "p": ["--transfer-peer", f"ipc://{transfer_sock}"],
    }
    mems, models, schedulers = {}, {}, {}
    for node, role in PD_NODES:
        decode = node == "d"
        pool = [*options.memsvc_args, *(options.decode_memsvc_args if decode else [])]
        mems[node] = service_spec(
            run_dir,
            f"memsvc-{node}",
            "memsvc",
            [*TINY_MODEL_POOL, *pool, "--pd-role", role, *transfer, *peers[node], *logging_args],
            kind="memsvc",
            extra_files=(transfer_sock,) if decode else (),
        )

    def via(spec: ProcessSpec) -> str:
        return options.via.get(spec.name, spec.address)

    for node, _ in PD_NODES:
        models[node] = service_spec(
            run_dir,
            f"model_svc-{node}",
            "model_svc",
            [
                "--memsvc",
                via(mems[node]),
                "--checkpoint",
                checkpoint,
                "--threads",
                "1",
                *options.model_args,
                *logging_args,
            ],
            kind="model_svc",
        )
    for node, role in PD_NODES:
        session_file = run_dir / f"scheduler-{node}.session"
        extra = options.decode_scheduler_args if node == "d" else []
        schedulers[node] = service_spec(
            run_dir,
            f"scheduler-{node}",
            "scheduler_svc",
            [
                "--mode",
                role,
                "--memsvc",
                via(mems[node]),
                "--worker",
                via(models[node]),
                "--memsvc-session-file",
                str(session_file),
                *options.scheduler_args,
                *extra,
                *logging_args,
            ],
            kind="scheduler_svc",
            env=dict(options.env),
            extra_files=(session_file,),
        )
    router = service_spec(
        run_dir,
        "router",
        "scheduler_svc.router",
        [
            "--prefill",
            via(schedulers["p"]),
            "--decode",
            via(schedulers["d"]),
            *options.router_args,
            *logging_args,
        ],
    )
    return [*mems.values(), *models.values(), *schedulers.values(), router]


def build_process_list(mode: str, run_dir: Path, options: StackOptions) -> list[ProcessSpec]:
    """The processes of a ``mode`` stack, in start order (the one place a mode is defined)."""
    if mode == "normal":
        return normal_stack(run_dir, options)
    if mode == "pd":
        return pd_stack(run_dir, options)
    raise StackUnavailableError(f"unknown stack mode {mode!r}")


# -- health --------------------------------------------------------------------------


def ping_memsvc(address: str, timeout_s: float) -> str:
    """hello + heartbeat + goodbye: memsvc serves sessions."""
    from memsvc.client import MemClient

    with MemClient(
        address,
        role="worker",
        name="kvstack-health",
        heartbeat=False,
        timeout_s=timeout_s,
        retries=0,
    ) as mem:
        mem.heartbeat()
        return f"epoch {mem.epoch}"


def ping_model(address: str, timeout_s: float) -> str:
    from model_svc.client import ModelClient

    with ModelClient(address, timeout_s=timeout_s, retries=0) as model:
        return f"pool epoch {model.info()['pool_epoch']}"


def ping_scheduler(address: str, timeout_s: float) -> str:
    from scheduler_svc.client import GenerateClient

    with GenerateClient(address, timeout_s=timeout_s, resubmits=0) as client:
        info = client.info()
    return f"running {info['num_running']}, waiting {info['num_waiting']}"


def ping_router(address: str, timeout_s: float) -> str:
    """The router's ``info``: it answers only with the decode node's (and says the prefill's)."""
    from scheduler_svc.client import GenerateClient

    with GenerateClient(address, timeout_s=timeout_s, resubmits=0) as client:
        info = client.info()
    if not info.get("ok"):
        raise RuntimeError(f"{info.get('code')}: {info.get('message')}")
    prefill = "answers" if info.get("prefill") else "SILENT"
    flights = (info.get("router") or {}).get("flights", 0)
    return f"decode running {info['num_running']}, prefill {prefill}, in flight {flights}"


HealthCheck = Callable[[str, float], str]
HEALTH_CHECKS: dict[str, HealthCheck] = {
    "memsvc": ping_memsvc,
    "model_svc": ping_model,
    "scheduler_svc": ping_scheduler,
    "router": ping_router,
}


def check(kind: str, address: str, timeout_s: float) -> tuple[bool, str]:
    """(healthy, detail) of one process; never raises."""
    ping = HEALTH_CHECKS.get(kind)
    if ping is None:
        return True, "no health check"
    try:
        return True, ping(address, timeout_s)
    except Exception as exc:  # any failure to answer is "unhealthy", with its reason
        return False, f"{type(exc).__name__}: {exc}"


# -- supervision ---------------------------------------------------------------------


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff: ``initial_s``, doubled per consecutive failure, at most ``max_s``."""

    initial_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 30.0  # up this long: the next failure starts again at initial_s
    ready_timeout_s: float = 120.0  # a start that is not serving by then is killed

    def delay(self, failures: int) -> float:
        return min(self.initial_s * 2 ** max(failures - 1, 0), self.max_s)


@dataclass
class Managed:
    """A supervised process and what happened to it."""

    spec: ProcessSpec
    proc: subprocess.Popen | None = None
    state: str = "stopped"  # starting | running | backoff | stopped
    spawned_at: float = 0.0
    ready_at: float = 0.0
    restart_at: float = 0.0
    restarts: int = 0
    failures: int = 0  # consecutive, for the backoff
    last_exit_code: int | None = None
    healthy: bool | None = None
    health: str = "unknown"
    info: dict[str, Any] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)  # every pid it has had

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def as_dict(self) -> dict[str, Any]:
        alive = self.proc is not None and self.proc.poll() is None
        return {
            "name": self.spec.name,
            "kind": self.spec.kind,
            "pid": self.pid,
            "address": self.spec.address,
            "state": self.state,
            "alive": alive,
            "healthy": self.healthy,
            "health": self.health,
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
            "log": str(self.spec.log_file),
            "ready": self.info,
        }


class Supervisor:
    """Starts, watches, restarts and stops one stack's processes (see the module docstring).

    ``new_session``: children get their own session (a terminal's Ctrl-C
    reaches only the supervisor, which stops them in order);
    ``die_with_parent``: children get SIGTERM if the supervisor dies (Linux;
    only for a supervisor that spawns from its main thread).
    """

    def __init__(
        self,
        specs: list[ProcessSpec],
        run_dir: str | os.PathLike,
        *,
        mode: str = "normal",
        policy: RestartPolicy | None = None,
        health_timeout_s: float = 3.0,
        health_interval_s: float = 5.0,
        stop_timeout_s: float = 30.0,
        new_session: bool = False,
        die_with_parent: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.mode = mode
        self.policy = policy or RestartPolicy()
        self.health_timeout_s = health_timeout_s
        self.health_interval_s = health_interval_s
        self.stop_timeout_s = stop_timeout_s
        self.new_session = new_session
        self.die_with_parent = die_with_parent
        self.procs = [Managed(spec) for spec in specs]
        self.status = "new"
        self.removed_segments: list[str] = []  # segments dead processes left (unlinked)
        self._lock = threading.RLock()
        self._stopping = False

    # -- access --------------------------------------------------------------

    def __getitem__(self, name: str) -> Managed:
        for managed in self.procs:
            if managed.spec.name == name:
                return managed
        raise KeyError(name)

    def pid(self, name: str) -> int | None:
        with self._lock:
            return self[name].pid

    def address(self, name: str) -> str:
        return self[name].spec.address

    def all_pids(self) -> set[int]:
        with self._lock:
            return {pid for m in self.procs for pid in m.pids}

    def live_pids(self) -> set[int]:
        with self._lock:
            return {m.pid for m in self.procs if m.proc is not None and m.proc.poll() is None}

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "mode": self.mode,
                "run_dir": str(self.run_dir),
                "status": self.status,
                "supervisor_pid": os.getpid(),
                "updated": time.time(),
                "processes": [m.as_dict() for m in self.procs],
            }

    # -- start -----------------------------------------------------------------

    def start(self, *, stop: threading.Event | None = None) -> None:
        """Start every process in order, each once the previous one serves and is healthy.

        Raises :class:`SupervisorError` (after stopping what it started) when
        one fails to come up within the policy's ready timeout, or when
        ``stop`` is set meanwhile.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.status = "starting"
        try:
            for managed in self.procs:
                self._spawn(managed)
                self._await_up(managed, stop)
        except BaseException:
            self.stop()
            self.status = "failed"
            self.write_state()
            raise
        self.status = "running"
        self.write_state()

    def _await_up(self, managed: Managed, stop: threading.Event | None) -> None:
        deadline = time.monotonic() + self.policy.ready_timeout_s
        name = managed.spec.name
        while True:
            if stop is not None and stop.is_set():
                raise SupervisorError(f"interrupted while starting {name}")
            if managed.proc.poll() is not None:
                raise SupervisorError(
                    f"{name} exited with code {managed.proc.returncode} while starting:\n"
                    f"{_tail(managed.spec.log_file)}"
                )
            if time.monotonic() > deadline:
                raise SupervisorError(
                    f"{name} did not become healthy within {self.policy.ready_timeout_s:.0f}s "
                    f"({managed.health}):\n{_tail(managed.spec.log_file)}"
                )
            if managed.state == "starting":
                self._check_ready(managed, time.monotonic())
            if managed.state == "running":
                self._probe(managed)
                if managed.healthy:
                    return
            time.sleep(0.05)

    def _spawn(self, managed: Managed) -> None:
        spec = managed.spec
        spec.ready_file.unlink(missing_ok=True)
        python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        with open(spec.log_file, "ab") as log_file:
            managed.proc = subprocess.Popen(
                spec.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": python_path, **spec.env},
                start_new_session=self.new_session,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        managed.pids.append(managed.proc.pid)
        managed.state = "starting"
        managed.spawned_at = time.monotonic()
        managed.healthy, managed.health, managed.info = None, "starting", {}
        log.info("started %s (pid %d)", spec.name, managed.proc.pid)

    def _check_ready(self, managed: Managed, now: float) -> None:
        try:
            managed.info = json.loads(managed.spec.ready_file.read_text())
        except (OSError, ValueError):
            return  # not written yet (it is replaced atomically)
        managed.state = "running"
        managed.ready_at = now
        log.info("%s serves %s (pid %d)", managed.spec.name, managed.spec.address, managed.pid)

    # -- supervision -------------------------------------------------------------

    def poll(self) -> None:
        """One round: reap what exited, promote what became ready, restart what is due."""
        with self._lock:
            if self._stopping:
                return
            now = time.monotonic()
            for managed in self.procs:
                self._poll_one(managed, now)
            self.write_state()

    def _poll_one(self, managed: Managed, now: float) -> None:
        if managed.proc is not None and managed.proc.poll() is not None:
            self._on_exit(managed, now)
        elif managed.state == "starting":
            self._check_ready(managed, now)
            if managed.state == "starting" and now - managed.spawned_at > (
                self.policy.ready_timeout_s
            ):
                waited = now - managed.spawned_at
                log.warning("%s is not serving after %.0fs: killing it", managed.spec.name, waited)
                managed.proc.kill()
        elif managed.state == "running" and now - managed.ready_at > self.policy.stable_s:
            managed.failures = 0
        if managed.state == "backoff" and now >= managed.restart_at:
            self._spawn(managed)

    def _on_exit(self, managed: Managed, now: float) -> None:
        proc = managed.proc
        code = proc.returncode
        self.removed_segments += remove_segments(proc.pid)
        managed.proc = None
        managed.failures += 1
        managed.restarts += 1
        managed.last_exit_code = code
        delay = self.policy.delay(managed.failures)
        managed.state = "backoff"
        managed.restart_at = now + delay
        managed.healthy, managed.health = False, f"exited with code {code}"
        log.warning(
            "%s exited with code %s; restarting in %.1fs (restart #%d)",
            managed.spec.name,
            code,
            delay,
            managed.restarts,
        )

    def check_health(self) -> dict[str, bool | None]:
        """Ping every serving process (outside the lock: a stalled one takes the timeout)."""
        for managed in list(self.procs):
            with self._lock:
                serving = managed.state == "running" and not self._stopping
            if serving:
                self._probe(managed)
        with self._lock:
            self.write_state()
            return {m.spec.name: m.healthy for m in self.procs}

    def _probe(self, managed: Managed) -> None:
        healthy, detail = check(managed.spec.kind, managed.spec.address, self.health_timeout_s)
        with self._lock:
            if managed.state == "running":
                managed.healthy, managed.health = healthy, "ok: " + detail if healthy else detail

    def healthy(self) -> bool:
        with self._lock:
            return all(m.state == "running" and m.healthy for m in self.procs)

    def wait_healthy(self, timeout_s: float) -> bool:
        """Poll and ping until every process serves and answers (or ``timeout_s`` passes)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            self.check_health()
            if self.healthy():
                return True
            time.sleep(0.2)
        return False

    def serve(self, stop: threading.Event, interval_s: float = 0.1) -> None:
        """``poll()`` until ``stop`` is set; health checks run in a thread beside it."""
        health = threading.Thread(target=self._health_loop, args=(stop,), name="health")
        health.start()
        try:
            while not stop.wait(interval_s):
                self.poll()
        finally:
            stop.set()
            health.join()

    def _health_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.health_interval_s):
            self.check_health()

    @contextlib.contextmanager
    def running(self) -> Iterator[Supervisor]:
        """``start()``, ``serve()`` in a background thread, and ``stop()`` on the way out."""
        stop = threading.Event()
        self.start(stop=stop)
        thread = threading.Thread(target=self.serve, args=(stop,), name="supervisor")
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.stop()

    # -- stop --------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process, last first; remove their segments, sockets and ready files."""
        with self._lock:
            self._stopping = True
            self.status = "stopping"
            self.write_state()
            for managed in reversed(self.procs):
                self._stop_one(managed)
            self.status = "stopped"
            self.write_state()

    def _stop_one(self, managed: Managed) -> None:
        proc = managed.proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot exit
                proc.terminate()
                try:
                    proc.wait(self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s ignored SIGTERM: killing it", managed.spec.name)
                    proc.kill()
                    proc.wait()
            managed.last_exit_code = proc.returncode
        for pid in managed.pids:
            self.removed_segments += remove_segments(pid)
        spec = managed.spec
        paths = [spec.ready_file, *spec.extra_files]
        if spec.address.startswith("ipc://"):
            paths.append(Path(spec.address[len("ipc://") :]))
        for path in paths:
            path.unlink(missing_ok=True)
        managed.proc = None
        managed.state = "stopped"
        managed.healthy, managed.health = None, "stopped"

    def write_state(self) -> None:
        path = self.run_dir / STATE_FILE
        tmp = path.with_name(STATE_FILE + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self.state(), indent=1))
            os.replace(tmp, path)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the supervisor dies (no orphans after a SIGKILL of it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- the command -----------------------------------------------------------------------


def default_run_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="kvstack-up-", dir=base))


def prepare_run_dir(path: str | None) -> Path:
    """The run directory: a fresh one, or ``path`` if no live supervisor uses it."""
    if path is None:
        return default_run_dir()
    run_dir = Path(path).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError, ValueError):
        state = json.loads((run_dir / STATE_FILE).read_text())
        pid = state.get("supervisor_pid")
        if state.get("status") not in ("stopped", "failed") and pid and pid_alive(pid):
            raise StackUnavailableError(f"a stack already runs in {run_dir} (supervisor pid {pid})")
    return run_dir


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=["normal", "pd"],
        default="normal",
        help="normal: memsvc + model_svc + scheduler_svc; pd: a prefill node, a decode node "
        "(each memsvc + model_svc + scheduler) and the router",
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="where sockets, logs and state.json go (default: a fresh folder under "
        "$XDG_RUNTIME_DIR or /tmp)",
    )
    parser.add_argument(
        "--checkpoint", default=None, help="model checkpoint (default: the bundled tiny model)"
    )
    pool = parser.add_argument_group("memsvc pool (must match the model)")
    for flag in ("--page-size", "--num-pages", "--max-running-requests", "--max-context-len"):
        pool.add_argument(flag, type=int, default=None, help=f"memsvc {flag}")
    pd = parser.add_argument_group("PD mode")
    pd.add_argument(
        "--transfer-backend",
        choices=["auto", "nixl", "zmq"],
        default="auto",
        help="how the memsvc pair moves KV pages (memsvc --transfer-backend)",
    )
    pd.add_argument(
        "--transfer-timeout",
        type=float,
        default=None,
        help="seconds without a word from the peer memsvc before its transfers fail "
        "(None: memsvc's own default)",
    )
    extra = parser.add_argument_group(
        "more flags for one service (repeat for each; PD: memsvc and scheduler flags go to both "
        "nodes)"
    )
    for name in ("memsvc", "model", "scheduler", "router"):
        extra.add_argument(
            f"--{name}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"pass ARG to {name} (e.g. --{name}-arg=--log-level=DEBUG)",
        )
    sup = parser.add_argument_group("supervision")
    sup.add_argument("--backoff-initial", type=float, default=0.5, help="first restart delay (s)")
    sup.add_argument("--backoff-max", type=float, default=30.0, help="longest restart delay (s)")
    sup.add_argument(
        "--stable-after",
        type=float,
        default=30.0,
        help="a process up this long (s) restarts at the first delay again",
    )
    sup.add_argument("--ready-timeout", type=float, default=120.0, help="seconds a start may take")
    sup.add_argument(
        "--health-interval", type=float, default=5.0, help="seconds between health checks"
    )
    sup.add_argument(
        "--health-timeout", type=float, default=3.0, help="seconds one health check may take"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="supervisor log verbosity (the services log at their default)",
    )


def options_from_args(args: argparse.Namespace) -> StackOptions:
    pool = []
    for name in ("page_size", "num_pages", "max_running_requests", "max_context_len"):
        value = getattr(args, name)
        if value is not None:
            pool += [f"--{name.replace('_', '-')}", str(value)]
    return StackOptions(
        checkpoint=args.checkpoint,
        memsvc_args=[*pool, *args.memsvc_arg],
        model_args=list(args.model_arg),
        scheduler_args=list(args.scheduler_arg),
        router_args=list(args.router_arg),
        transfer_backend=args.transfer_backend,
        transfer_timeout=args.transfer_timeout,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        run_dir = prepare_run_dir(args.run_dir)
        specs = build_process_list(args.mode, run_dir, options_from_args(args))
    except StackUnavailableError as exc:
        print(f"kvstack up: error: {exc}", file=sys.stderr)
        return 2
    handler = logging.FileHandler(run_dir / "supervisor.log")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    supervisor = Supervisor(
        specs,
        run_dir,
        mode=args.mode,
        policy=RestartPolicy(
            args.backoff_initial, args.backoff_max, args.stable_after, args.ready_timeout
        ),
        health_timeout_s=args.health_timeout,
        health_interval_s=args.health_interval,
        new_session=True,
        die_with_parent=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        supervisor.start(stop=stop)
    except SupervisorError as exc:
        print(f"kvstack up: error: {exc}", file=sys.stderr)
        return 1
    try:
        print(
            f"kvstack up: {args.mode} stack running in {run_dir}; generate API at "
            f"{supervisor.address(specs[-1].name)}; `kvstack status --run-dir {run_dir}`",
            flush=True,
        )
        supervisor.serve(stop)
        log.info("stopping the stack")
    finally:
        supervisor.stop()
    print("kvstack up: stopped", flush=True)
    return 0
