"""Start real service processes for tests, and always reap them (fixtures in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from kvstack.stack.launch import Launcher
from kvstack.stack.process import REPO, Service, remove_segments, start_service
from memsvc.core.backends.shm import list_segments, segment_owner_pid

__all__ = [
    "REPO",
    "SMALL_POOL",
    "Stack",
    "at_once",
    "kill_parent_of_stack",
    "kill_processes",
    "processes_with",
    "start_memsvc",
    "start_service",
    "start_stack",
    "wait_for",
]

ServiceProcess = MemsvcProcess = Service
SMALL_POOL = [
    "--num-layers",
    "1",
    "--num-kv-heads",
    "1",
    "--head-dim",
    "8",
    "--page-size",
    "4",
    "--num-pages",
    "64",
    "--max-running-requests",
    "8",
    "--max-context-len",
    "256",
]


def start_memsvc(
    tmp_path: Path, *extra: str, name: str = "memsvc", address: str | None = None
) -> Service:
    return start_service(tmp_path, "memsvc", *SMALL_POOL, *extra, name=name, address=address)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny model, written once for every test that starts a model_svc."""
    from model_svc.tiny import write_tiny_checkpoint  # imports torch: only when used

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Starts service processes; all are stopped (killed if need be) after the test, last first."""
    with Launcher(tmp_path) as started:
        yield started
    # The launcher unlinks what a stopped service left; that it had to is a leak.
    assert not started.leaked_segments, f"services left shm segments: {started.leaked_segments}"


@pytest.fixture
def service_factory(launcher: Launcher):
    return launcher.start


@pytest.fixture
def memsvc_factory(service_factory) -> Iterator:
    """Start memsvc processes (small pool by default, extra flags override)."""

    def factory(*extra: str, **kwargs) -> Service:
        return service_factory("memsvc", *SMALL_POOL, *extra, **kwargs)

    return factory


@pytest.fixture
def memsvc(memsvc_factory) -> Service:
    return memsvc_factory()


@dataclass
class Stack:
    memsvc: Service
    model: Service
    scheduler: Service


def start_stack(
    launcher: Launcher,
    checkpoint: Path,
    pool: list[str],
    scheduler: list[str] = (),
    *,
    name: str = "",
    env: dict[str, str] | None = None,
) -> Stack:
    """memsvc + model_svc + scheduler_svc (normal mode), stopped with the launcher."""
    return Stack(*launcher.start_normal_stack(checkpoint, pool, scheduler, suffix=name, env=env))


def processes_with(text: str) -> dict[int, str]:
    """Running processes whose command line holds ``text`` (a run's unique folder), by pid."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if text in line:
            found[int(cmdline.parent.name)] = line
    return found


def kill_processes(pids: list[int]) -> list[str]:
    """SIGKILL ``pids`` (not children of this process) and unlink their shm segments.

    Returns the segments' names.
    """
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [name for pid in pids for name in remove_segments(pid)]


T = TypeVar("T")


def at_once(calls: list[Callable[[], T]]) -> list[T]:
    """Each call's result, in order, the calls run together in threads: for probes that
    each wait out a timeout (a peer that must not answer), which add up one by one."""
    with ThreadPoolExecutor(max(len(calls), 1)) as pool:
        return list(pool.map(lambda call: call(), calls))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """``predicate()``'s first true value (an OSError, ValueError or KeyError counts as
    false: a file not yet written); AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            value = predicate()
            if value:
                return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def kill_parent_of_stack(parent: subprocess.Popen, marker: Path, timeout: float) -> None:
    """SIGKILL ``parent``, which started a stack whose every process has ``marker`` (a
    unique folder) in its command line: they must all exit within ``timeout`` seconds,
    and memsvc must still unlink its shared memory. (A ``finally`` reaps what is left
    with ``kill_processes(processes_with(str(marker)))``.)"""
    stack = processes_with(str(marker))
    segments = [s for s in list_segments() if segment_owner_pid(s) in stack]
    assert any("memsvc" in line for line in stack.values()) and segments, stack
    parent.kill()
    parent.wait()
    wait_for(lambda: not processes_with(str(marker)), timeout, "the stack to exit with its parent")
    left = [s for s in list_segments() if segment_owner_pid(s) in stack]
    logs = "\n".join(f"== {log}\n{log.read_text()}" for log in marker.glob("**/memsvc*.log"))
    assert not left, f"shared memory left behind: {left}; {stack}\n{logs}"
