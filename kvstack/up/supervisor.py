"""The supervisor behind ``kvstack up``: start a stack, restart what dies, stop it cleanly.

:class:`Supervisor` runs a list of :class:`~kvstack.stack.spec.ProcessSpec`
(``kvstack up`` uses it; tests, the fault harness and ``kvstack serve`` can too):

- ``start()`` starts the processes in order, each once the previous one
  serves (it wrote its ready file) and answers its health check; those whose
  spec ``starts_early`` (model_svc, which waits for its memsvc itself) are
  spawned first of all, so their start-up overlaps the others';
- ``poll()`` (``serve()`` calls it in a loop) reaps a process that exited,
  logs ``"memsvc exited with code -9; restarting in 0.5s (restart #1)"`` and
  starts it again after an exponential backoff with a cap (a process that
  stayed up for ``stable_s`` starts over at the shortest delay). A dead
  memsvc's shared-memory segments are unlinked before its successor starts.
  Only the dead process restarts: the others reconnect to it themselves;
- ``stop()`` stops the processes last first (SIGTERM, then SIGKILL after a
  grace period) and removes their shm segments, sockets and ready files. A
  process that drains on SIGTERM (``ProcessSpec.drains``: a PD decode scheduler
  with ``--migrate-to``) is signalled first, and the others stay up until it
  exited or ``drain_timeout_s`` passed: its requests move to its peer and their
  replies still reach their clients through the router.

The state file (``state.json`` in the run directory) holds every process's
pid, address, state, health and restarts; ``kvstack status`` reads it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstack.stack.process import REPO, exit_status, log_tail, remove_segments, service_env
from kvstack.stack.spec import ProcessSpec
from kvstack.up.health import check
from memsvc.cli import make_private_dirs, open_private_log, write_private_file
from memsvc.curve import KeyFolder

log = logging.getLogger("kvstack.supervisor")

STATE_FILE = "state.json"


class SupervisorError(RuntimeError):
    """The stack did not come up; the message says which process and shows its log."""


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
    ``die_with_parent``: children get SIGTERM if the supervisor's process dies,
    SIGKILLed or not, whichever thread spawned them (:mod:`memsvc.lifeline`). ``curve``: the
    stack's keys when its sockets have CURVE on (the health checks use its
    client keys; the state file names its folder for ``kvstack status``).
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
        drain_timeout_s: float = 600.0,
        new_session: bool = False,
        die_with_parent: bool = True,
        curve: KeyFolder | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.curve = curve
        self._client_keys = curve.client_keys() if curve is not None else None
        self.mode = mode
        self.policy = policy or RestartPolicy()
        self.health_timeout_s = health_timeout_s
        self.health_interval_s = health_interval_s
        self.stop_timeout_s = stop_timeout_s
        self.drain_timeout_s = drain_timeout_s
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
                "curve_dir": str(self.curve.path) if self.curve is not None else None,
                "updated": time.time(),
                "processes": [m.as_dict() for m in self.procs],
            }

    # -- start -----------------------------------------------------------------

    def start(self, *, stop: threading.Event | None = None) -> None:
        """Start every process in order, each once the previous one serves and is healthy
        (those that start early are spawned first, see the module docstring).

        Raises :class:`SupervisorError` (after stopping what it started) when
        one fails to come up within the policy's ready timeout, or when
        ``stop`` is set meanwhile.
        """
        make_private_dirs(self.run_dir)
        self.status = "starting"
        try:
            for managed in self.procs:  # a last run's, not to be taken for this one's
                managed.spec.ready_file.unlink(missing_ok=True)
            for managed in self.procs:
                if managed.spec.starts_early:
                    self._spawn(managed)
            for managed in self.procs:
                if managed.proc is None:
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
                    f"{name} {exit_status(managed.proc.returncode)} while starting; "
                    f"{log_tail(managed.spec.log_file)}"
                )
            if time.monotonic() > deadline:
                raise SupervisorError(
                    f"{name} did not become healthy within {self.policy.ready_timeout_s:.0f}s "
                    f"({managed.health}); {log_tail(managed.spec.log_file)}"
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
        with open_private_log(spec.log_file) as log_file:
            managed.proc = subprocess.Popen(
                spec.command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=service_env(spec.env, die_with_parent=self.die_with_parent),
                start_new_session=self.new_session,
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
        healthy, detail = check(
            managed.spec.kind, managed.spec.address, self.health_timeout_s, self._client_keys
        )
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
            self._drain()
            for managed in reversed(self.procs):
                self._stop_one(managed)
            self.status = "stopped"
            self.write_state()

    def _drain(self) -> None:
        """SIGTERM the processes that drain on it, then wait for them (the rest serves)."""
        draining = [
            m for m in self.procs if m.spec.drains and m.proc is not None and m.proc.poll() is None
        ]
        for managed in draining:
            log.info("draining %s (SIGTERM; the stack serves until it exits)", managed.spec.name)
            _terminate(managed.proc)
        deadline = time.monotonic() + self.drain_timeout_s
        for managed in draining:
            try:
                managed.proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                name, limit = managed.spec.name, self.drain_timeout_s
                log.warning("%s did not drain in %.0fs: stopping it", name, limit)

    def _stop_one(self, managed: Managed) -> None:
        proc = managed.proc
        if proc is not None:
            if proc.poll() is None:
                _terminate(proc)
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
        with contextlib.suppress(OSError):
            write_private_file(self.run_dir / STATE_FILE, json.dumps(self.state(), indent=1))


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc``, after a SIGCONT: a stopped process cannot exit."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
