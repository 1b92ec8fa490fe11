"""PD kill test: memsvc-D restarts while the stack is idle (issue 18, defect 2).

The reproducer, on a supervised PD stack with 256-token pools (as ``kvstack
up --mode pd`` runs it): SIGKILL memsvc-d while nothing runs, wait until the
stack is healthy again, then send a prompt of 200 tokens. The decode node's
first step finds the new memsvc-D and re-bootstraps that request under a new
room; the router must abort the prefill still running for the old room, or
its pages stay held on the prefill node, the re-bootstrapped prompt never
fits beside them and every later request waits behind it in the FIFO queue.

After the fault every request completes (the long one twice, with the same
tokens), ``kvstack status`` says healthy, and neither memsvc holds a page.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from collections.abc import Iterator

import pytest

from kvstack.stack.spec import StackOptions, pd_stack
from kvstack.up.cli import pid_alive
from kvstack.up.status import inspect
from kvstack.up.supervisor import RestartPolicy, Supervisor
from memsvc.client import MemClient
from memsvc.core.backends.shm import list_segments, segment_owner_pid
from scheduler_svc.client import GenerateClient
from tests.faults.harness import _busy, temp_workdir

pytestmark = pytest.mark.timeout(600)

POOL = ["--page-size", "4", "--num-pages", "64", "--max-context-len", "512"]  # 256 tokens
LONG_PROMPT = [random.Random(18).randrange(256) for _ in range(200)]
SHORT_PROMPT = list(range(3, 13))
SAMPLING = {"max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    workdir = temp_workdir()
    run_dir = workdir / "run"
    specs = pd_stack(run_dir, StackOptions(memsvc_args=POOL, transfer_backend="zmq"))
    policy = RestartPolicy(initial_s=0.2, max_s=3.0, stable_s=5.0, ready_timeout_s=180.0)
    stack = Supervisor(
        specs, run_dir, mode="pd", policy=policy, health_interval_s=1.0, health_timeout_s=3.0
    )
    try:
        with stack.running():
            yield stack
        pids = stack.all_pids()
        assert not [pid for pid in pids if pid_alive(pid)], "processes left after stop"
        assert not [n for n in list_segments() if segment_owner_pid(n) in pids]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def generate(router: str, prompt: list[int]) -> list[int]:
    with GenerateClient(router, timeout_s=30, resubmits=1) as client:
        result = client.generate(prompt, sampling=SAMPLING)
    assert result.finish_reason.get("type") == "length", result
    return result.output_ids


def wait_idle(supervisor: Supervisor, timeout_s: float = 60) -> None:
    """Router, both schedulers and both memsvc idle: nothing queued, no page held."""
    deadline = time.monotonic() + timeout_s
    while True:
        with GenerateClient(supervisor.address("router"), timeout_s=10, resubmits=0) as client:
            busy = _busy(client.info())
        held = {}
        for name in ("memsvc-d", "memsvc-p"):
            with MemClient(supervisor.address(name), timeout_s=5) as mem:
                stats = mem.stats()
                held[name] = (stats["held"], stats["open_requests"], stats["transfer"]["rooms"])
        if not busy and all(h[0] == 0 and h[1] == 0 for h in held.values()):
            break
        assert time.monotonic() < deadline, f"not idle: {busy}, memsvc {held}"
        time.sleep(0.5)
    for name in ("memsvc-d", "memsvc-p"):
        with MemClient(supervisor.address(name), timeout_s=5) as mem:
            mem.check(idle=True)


def test_idle_decode_memsvc_restart_then_a_long_prompt(supervisor: Supervisor) -> None:
    router = supervisor.address("router")
    assert len(generate(router, SHORT_PROMPT)) == SAMPLING["max_new_tokens"]

    os.kill(supervisor.pid("memsvc-d"), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while supervisor["memsvc-d"].restarts < 1 or not supervisor.wait_healthy(5):
        assert time.monotonic() < deadline, f"memsvc-d not back: {supervisor.state()}"
    assert inspect(supervisor.run_dir, 3.0)["healthy"]

    started = time.monotonic()
    first = generate(router, LONG_PROMPT)
    assert time.monotonic() - started < 30
    assert len(generate(router, SHORT_PROMPT)) == SAMPLING["max_new_tokens"]
    assert generate(router, LONG_PROMPT) == first  # greedy: the fault changed no token
    wait_idle(supervisor)
    state = inspect(supervisor.run_dir, 3.0)
    assert state["healthy"], [(p["name"], p["health"]) for p in state["processes"]]
