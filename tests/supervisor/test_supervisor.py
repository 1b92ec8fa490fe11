"""``kvstack up`` / ``kvstack status`` as a user runs them, and the Supervisor's restart policy.

The stack test runs ``kvstack up`` as a subprocess and always reaps it and
every process it started (by the pids in its state file), whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstack.stack.spec import (
    ProcessSpec,
    StackOptions,
    StackUnavailableError,
    build_process_list,
)
from kvstack.up.cli import pid_alive, prepare_run_dir
from kvstack.up.supervisor import STATE_FILE, RestartPolicy, Supervisor
from memsvc.core.backends.shm import SHM_DIR, list_segments, segment_owner_pid
from memsvc.lifeline import child_env
from scheduler_svc.client import GenerateClient
from tests.procs import REPO, processes_with, wait_for

pytestmark = pytest.mark.timeout(600)

POOL = ["--page-size", "4", "--num-pages", "64", "--max-context-len", "512"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def kvstack(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstack.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=ENV,
        check=False,
    )


def read_state(run_dir: Path) -> dict:
    return json.loads((run_dir / STATE_FILE).read_text())


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short path (ipc:// socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvsup-", dir="/tmp"))
    yield path
    with contextlib.suppress(OSError):
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


class UpProcess:
    """``kvstack up`` in the background; :meth:`reap` kills what is left, whatever happened."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.log = run_dir / "up.out"
        self.pids: set[int] = set()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstack.cli", "up", "--run-dir", str(run_dir), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**ENV, **child_env()},
            )

    def state(self) -> dict:
        state = read_state(self.run_dir)
        self.pids |= {p["pid"] for p in state["processes"] if p["pid"]}
        return state

    def pid(self, name: str) -> int:
        return next(p["pid"] for p in self.state()["processes"] if p["name"] == name)

    def healthy(self) -> dict | None:
        state = self.state()
        procs = state["processes"]
        if state["status"] == "running" and all(p["healthy"] and p["alive"] for p in procs):
            return state
        return None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_and_await_restart(self, name: str) -> int:
        """SIGKILL ``name``; return its old pid once a new one runs and all are healthy."""
        old = self.pid(name)
        os.kill(old, signal.SIGKILL)

        def restarted() -> bool:
            state = self.healthy()
            return bool(state) and any(
                p["name"] == name and p["restarts"] == 1 for p in state["processes"]
            )

        wait_for(restarted, 180, f"{name} restarted:\n{self.output()}")
        assert self.pid(name) != old
        assert f"{name} exited with code -9; restarting in 0.2s (restart #1)" in self.output()
        return old

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError, ValueError):
            self.state()
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        for name in list_segments():
            if segment_owner_pid(name) in self.pids:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))


@pytest.fixture
def up(run_dir: Path) -> Iterator[UpProcess]:
    started: list[UpProcess] = []

    def start(*args: str) -> UpProcess:
        started.append(UpProcess(run_dir, *args))
        return started[-1]

    yield start
    for process in started:
        process.reap()


def generate(address: str) -> list[int]:
    with GenerateClient(address, timeout_s=60) as client:
        result = client.generate(
            list(range(3, 40)), sampling={"max_new_tokens": 24, "ignore_eos": True}
        )
    assert len(result.output_ids) == 24, result
    return result.output_ids


def test_up_status_restart_and_stop(up, run_dir: Path) -> None:
    stack = up("--mode", "normal", *POOL, "--backoff-initial", "0.2", "--health-interval", "1")
    state = wait_for(stack.healthy, 240, f"a healthy stack:\n{stack.output()}")
    names = [p["name"] for p in state["processes"]]
    assert names == ["memsvc", "model_svc", "scheduler_svc"]
    scheduler = state["processes"][2]["address"]
    assert scheduler == f"ipc://{run_dir}/scheduler_svc.sock"

    status = kvstack("status", "--run-dir", str(run_dir))
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.strip().endswith("healthy")
    for name in names:
        assert name in status.stdout
    want = generate(scheduler)
    # the state, the scheduler's memsvc session and the logs: the user's alone (issue 26, 13)
    private = [run_dir / STATE_FILE, *run_dir.glob("*.session"), *run_dir.glob("*.log")]
    assert len(private) == 1 + 1 + 4, private  # supervisor.log and one log per service
    assert {p.name: mode(p) for p in private} == {p.name: 0o600 for p in private}

    # model_svc dies: it is restarted, and the same request gives the same tokens
    old_model = stack.kill_and_await_restart("model_svc")
    assert generate(scheduler) == want
    by_json = json.loads(kvstack("status", "--run-dir", str(run_dir), "--json").stdout)
    assert [p["restarts"] for p in by_json["processes"]] == [0, 1, 0]

    # a stalled process makes status fail (and name it)
    stalled = stack.pid("scheduler_svc")
    os.kill(stalled, signal.SIGSTOP)
    try:
        status = kvstack("status", "--run-dir", str(run_dir), "--timeout", "1")
    finally:
        os.kill(stalled, signal.SIGCONT)
    assert status.returncode == 1, status.stdout
    assert "UNHEALTHY" in status.stdout
    bad = [line for line in status.stdout.splitlines() if " BAD " in line]
    assert len(bad) == 1 and bad[0].startswith("scheduler_svc"), status.stdout

    # SIGTERM: everything stops, last first, and nothing is left behind
    pids = set(stack.pids) | {old_model}
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(120) == 0, stack.output()
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not [n for n in list_segments() if segment_owner_pid(n) in pids]
    assert not list(run_dir.glob("*.sock")) and not list(run_dir.glob("*.ready"))
    assert read_state(run_dir)["status"] == "stopped"
    assert kvstack("status", "--run-dir", str(run_dir)).returncode == 1  # nothing runs


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_run_dir_kvstack_creates_is_private_and_so_is_its_state(tmp_path: Path) -> None:
    """Issue 26, item 13: the run dir was 0755 and state.json 0644."""
    run_dir = prepare_run_dir(str(tmp_path / "new" / "run"))
    assert mode(tmp_path / "new") == mode(run_dir) == 0o700
    stale = run_dir / f"{STATE_FILE}.tmp"  # left by a supervisor that died writing it
    stale.write_text("{}")
    stale.chmod(0o644)
    Supervisor([], run_dir).write_state()
    assert mode(run_dir / STATE_FILE) == 0o600 and json.loads((run_dir / STATE_FILE).read_text())
    Supervisor([], tmp_path / "started").start()
    assert mode(tmp_path / "started") == 0o700
    given = tmp_path / "given"
    given.mkdir(mode=0o750)
    assert mode(prepare_run_dir(str(given))) == 0o750  # one the user made keeps its mode


def test_a_killed_up_leaves_no_service_or_segment(up, run_dir: Path) -> None:
    """SIGKILL ``kvstack up``: every process it started, a restarted one too, follows it
    (SIGTERM, so memsvc still unlinks its shared memory)."""
    stack = up("--mode", "normal", *POOL, "--backoff-initial", "0.2", "--health-interval", "1")
    wait_for(stack.healthy, 240, f"a healthy stack:\n{stack.output()}")
    stack.kill_and_await_restart("model_svc")  # spawned again by the supervision loop
    pids = set(stack.pids)
    assert [n for n in list_segments() if segment_owner_pid(n) in pids]
    stack.proc.kill()
    stack.proc.wait()
    wait_for(lambda: not processes_with(str(run_dir)), 60, "the services to exit")
    assert not [n for n in list_segments() if segment_owner_pid(n) in pids]


PD_NAMES = [
    "memsvc-d",
    "memsvc-p",
    "model_svc-d",
    "model_svc-p",
    "scheduler-d",
    "scheduler-p",
    "router",
]


def test_pd_process_list_is_wired(run_dir: Path) -> None:
    specs = {s.name: s for s in build_process_list("pd", run_dir, StackOptions())}
    assert list(specs) == PD_NAMES

    def arg(name: str, flag: str) -> str:
        command = specs[name].command
        return command[command.index(flag) + 1]

    assert arg("memsvc-p", "--transfer-peer") == arg("memsvc-d", "--transfer-listen")
    for node, role in (("d", "decode"), ("p", "prefill")):
        assert arg(f"memsvc-{node}", "--pd-role") == role
        assert arg(f"model_svc-{node}", "--memsvc") == specs[f"memsvc-{node}"].address
        assert arg(f"scheduler-{node}", "--mode") == role
        assert arg(f"scheduler-{node}", "--memsvc") == specs[f"memsvc-{node}"].address
        assert arg(f"scheduler-{node}", "--worker") == specs[f"model_svc-{node}"].address
        assert arg(f"scheduler-{node}", "--memsvc-session-file")
    assert arg("router", "--prefill") == specs["scheduler-p"].address
    assert arg("router", "--decode") == specs["scheduler-d"].address
    assert specs["router"].kind == "router"
    with pytest.raises(StackUnavailableError, match="unknown stack mode"):
        build_process_list("both", run_dir, StackOptions())


@pytest.mark.parametrize("mode", ["normal", "pd"])
def test_every_scheduler_tokenizes_with_the_models_tokenizer(
    run_dir: Path, checkpoint: Path, mode: str
) -> None:
    """A scheduler without --checkpoint tokenizes text as bytes: SmolLM2's "Hello" would be
    bos + 5 bytes instead of its one token."""
    specs = build_process_list(mode, run_dir, StackOptions(checkpoint=str(checkpoint)))
    schedulers = [s for s in specs if s.kind == "scheduler_svc"]
    assert len(schedulers) == (1 if mode == "normal" else 2)
    for spec in schedulers:
        command = spec.command
        assert command[command.index("--checkpoint") + 1] == str(checkpoint), command


def test_pd_up_status_restart_and_stop(up, run_dir: Path) -> None:
    stack = up(
        "--mode",
        "pd",
        *POOL,
        "--transfer-backend",
        "zmq",
        "--scheduler-arg=--num-reserved-decode-tokens=8",
        "--backoff-initial",
        "0.2",
        "--health-interval",
        "1",
    )
    state = wait_for(stack.healthy, 300, f"a healthy PD stack:\n{stack.output()}")
    assert [p["name"] for p in state["processes"]] == PD_NAMES
    router = state["processes"][-1]["address"]
    assert router == f"ipc://{run_dir}/router.sock"
    status = kvstack("status", "--run-dir", str(run_dir))
    assert status.returncode == 0, status.stdout + status.stderr
    assert "mode pd" in status.stdout and status.stdout.strip().endswith("healthy")
    for name in PD_NAMES:
        assert name in status.stdout
    want = generate(router)

    # the prefill scheduler dies: it comes back at the same address, the router
    # reconnects (and notices the new process), and the same request gives the same tokens
    old = stack.kill_and_await_restart("scheduler-p")
    assert generate(router) == want

    pids = set(stack.pids) | {old}
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(120) == 0, stack.output()
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not [n for n in list_segments() if segment_owner_pid(n) in pids]
    assert not list(run_dir.glob("*.sock")) and not list(run_dir.glob("*.ready"))
    assert not list(run_dir.glob("*.session"))
    assert read_state(run_dir)["status"] == "stopped"


def test_status_without_a_stack(run_dir: Path) -> None:
    status = kvstack("status", "--run-dir", str(run_dir))
    assert status.returncode == 2
    assert "no supervised stack" in status.stderr


def flaky_spec(run_dir: Path, name: str = "flaky") -> ProcessSpec:
    """A process that says it is ready, lives 0.3 s, and exits with code 3."""
    ready = run_dir / f"{name}.ready"
    code = (
        "import json, os, sys, time; "
        f"open({str(ready)!r}, 'w').write(json.dumps({{'pid': os.getpid()}})); "
        "time.sleep(0.3); sys.exit(3)"
    )
    return ProcessSpec(
        name,
        "none",  # no health check
        (sys.executable, "-c", code),
        f"ipc://{run_dir}/{name}.sock",
        ready,
        run_dir / f"{name}.log",
    )


def test_restarts_back_off_exponentially_up_to_the_cap(run_dir: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvstack.supervisor")
    policy = RestartPolicy(initial_s=0.1, max_s=0.4, stable_s=60, ready_timeout_s=30)
    supervisor = Supervisor([flaky_spec(run_dir)], run_dir, policy=policy, stop_timeout_s=5)

    def restarted_five_times() -> bool:
        supervisor.poll()
        return supervisor["flaky"].restarts >= 5

    try:
        supervisor.start()
        wait_for(restarted_five_times, 60, "five restarts", interval=0.02)
        pids = supervisor.all_pids()
    finally:
        supervisor.stop()
    lines = [r.getMessage() for r in caplog.records if "exited with code" in r.getMessage()]
    assert lines[:5] == [
        "flaky exited with code 3; restarting in 0.1s (restart #1)",
        "flaky exited with code 3; restarting in 0.2s (restart #2)",
        "flaky exited with code 3; restarting in 0.4s (restart #3)",
        "flaky exited with code 3; restarting in 0.4s (restart #4)",
        "flaky exited with code 3; restarting in 0.4s (restart #5)",
    ]
    assert len(pids) >= 5 and not [pid for pid in pids if pid_alive(pid)]
    state = read_state(run_dir)
    assert state["status"] == "stopped" and state["processes"][0]["last_exit_code"] in (3, -15)


def waiting_spec(run_dir: Path, name: str, waits_for: Path, **kw) -> ProcessSpec:
    """A process that writes ``NAME.started``, then, once ``waits_for`` exists, its ready
    file with what ``waits_for`` held; then it sleeps until stopped."""
    ready = run_dir / f"{name}.ready"
    code = (
        "import json, os, pathlib, time; "
        f"pathlib.Path({str(run_dir / f'{name}.started')!r}).write_text('{{}}'); "
        f"other = pathlib.Path({str(waits_for)!r}); "
        "exec('while not other.exists(): time.sleep(0.02)'); "
        f"pathlib.Path({str(ready)!r}).write_text("
        "json.dumps({'pid': os.getpid(), 'saw': json.loads(other.read_text())})); "
        "time.sleep(600)"
    )
    return ProcessSpec(
        name,
        "none",  # no health check
        (sys.executable, "-c", code),
        f"ipc://{run_dir}/{name}.sock",
        ready,
        run_dir / f"{name}.log",
        **kw,
    )


def test_a_process_that_starts_early_overlaps_those_before_it(run_dir: Path) -> None:
    """model_svc is spawned with memsvc and waits for memsvc's ready file itself: here
    ``first`` is only ready once ``early`` has started, which a start in order would never
    see (it would wait for ``first`` before spawning ``early``). A ready file a last run
    left is removed first, so ``early`` waits for the new one."""
    first = waiting_spec(run_dir, "first", run_dir / "early.started")
    early = waiting_spec(run_dir, "early", first.ready_file, starts_early=True)
    first.ready_file.write_text(json.dumps({"pid": 0}))  # stale, from a last run
    policy = RestartPolicy(ready_timeout_s=60)
    supervisor = Supervisor([first, early], run_dir, policy=policy, stop_timeout_s=5)
    try:
        supervisor.start()
        assert supervisor.healthy()
        assert supervisor["early"].info["saw"]["pid"] == supervisor.pid("first")
        pids = supervisor.all_pids()
    finally:
        supervisor.stop()
    assert len(pids) == 2 and not [pid for pid in pids if pid_alive(pid)]


def draining_spec(run_dir: Path, other: ProcessSpec) -> ProcessSpec:
    """A process that, on SIGTERM, drains for a second (as a decode scheduler with
    --migrate-to moves its requests), then writes ``drained.json``: whether ``other``
    was still up by then; then it exits."""
    ready, out = run_dir / "drainer.ready", run_dir / "drained.json"
    code = f"""
import json, os, pathlib, signal, time
other = pathlib.Path({str(other.ready_file)!r})
def drain(*_):
    time.sleep(1.0)
    pid = json.loads(other.read_text())["pid"]
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    pathlib.Path({str(out)!r}).write_text(json.dumps({{"other_alive": alive}}))
    os._exit(0)
signal.signal(signal.SIGTERM, drain)
pathlib.Path({str(ready)!r}).write_text(json.dumps({{"pid": os.getpid()}}))
while True:
    time.sleep(1)
"""
    return ProcessSpec(
        "drainer",
        "none",
        (sys.executable, "-c", code),
        f"ipc://{run_dir}/drainer.sock",
        ready,
        run_dir / "drainer.log",
        drains=True,
    )


def test_a_draining_process_stops_first_while_the_rest_serves(run_dir: Path) -> None:
    """SIGTERM to `kvstack up` with a decode scheduler that drains (--migrate-to): it
    is signalled first and the rest of the stack (here ``other``, which a stop in
    reverse start order would stop first) stays up until it exited."""
    other = waiting_spec(run_dir, "other", run_dir / "drainer.ready")
    drainer = draining_spec(run_dir, other)
    policy = RestartPolicy(ready_timeout_s=60)
    supervisor = Supervisor([drainer, other], run_dir, policy=policy, stop_timeout_s=5)
    try:
        supervisor.start()
        pids = supervisor.all_pids()
    finally:
        supervisor.stop()
    drained = json.loads((run_dir / "drained.json").read_text())
    (run_dir / "drained.json").unlink()
    assert drained == {"other_alive": True}, "the rest of the stack stopped before the drain"
    assert supervisor["drainer"].last_exit_code == 0  # it drained and exited, not killed
    assert len(pids) == 2 and not [pid for pid in pids if pid_alive(pid)]


def test_pd_stack_marks_a_decode_scheduler_with_a_peer_as_draining(run_dir: Path) -> None:
    options = StackOptions(decode_scheduler_args=["--migrate-to=ipc:///tmp/peer.sock"])
    specs = {s.name: s for s in build_process_list("pd", run_dir, options)}
    assert specs["scheduler-d"].drains and "--migrate-to=ipc:///tmp/peer.sock" in (
        specs["scheduler-d"].command
    )
    assert not specs["scheduler-p"].drains and not specs["router"].drains
    plain = {s.name: s for s in build_process_list("pd", run_dir, StackOptions())}
    assert not plain["scheduler-d"].drains


def test_decode_scheduler_args_need_a_pd_stack(run_dir: Path) -> None:
    done = kvstack("up", "--run-dir", str(run_dir), "--decode-scheduler-arg=--migrate-to=x")
    assert done.returncode == 2
    assert "--decode-scheduler-arg is for one PD stack (--mode pd)" in done.stderr
