"""Start real service processes for tests, and always reap them (fixtures in tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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


@dataclass
class ServiceProcess:
    """A started service: its process, address and what its ready file said."""

    proc: subprocess.Popen
    address: str
    info: dict
    log_path: Path

    @property
    def epoch(self) -> str | None:
        return self.info.get("epoch")

    @property
    def metrics_port(self) -> int | None:
        return self.info.get("metrics_port")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


MemsvcProcess = ServiceProcess


def start_service(
    tmp_path: Path,
    module: str,
    *args: str,
    name: str | None = None,
    address: str | None = None,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """``python -m module --listen ADDRESS --ready-file F *args``, once it is serving."""
    name = name or module
    address = address or f"ipc://{tmp_path}/{name}.sock"
    ready = tmp_path / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = tmp_path / f"{name}.log"
    command = [sys.executable, "-m", module, "--listen", address, "--ready-file", str(ready), *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{name} did not start:\n{log_path.read_text()}")
        time.sleep(0.02)
    return ServiceProcess(proc, address, json.loads(ready.read_text()), log_path)


def start_memsvc(
    tmp_path: Path, *extra: str, name: str = "memsvc", address: str | None = None
) -> ServiceProcess:
    return start_service(tmp_path, "memsvc", *SMALL_POOL, *extra, name=name, address=address)


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator:
    """Start service processes; all are stopped (killed if need be) after the test, last first."""
    started: list[ServiceProcess] = []

    def factory(module: str, *args: str, **kwargs) -> ServiceProcess:
        svc = start_service(tmp_path, module, *args, **kwargs)
        started.append(svc)
        return svc

    yield factory
    for svc in reversed(started):
        svc.stop()


@pytest.fixture
def memsvc_factory(service_factory) -> Iterator:
    """Start memsvc processes (small pool by default, extra flags override)."""

    def factory(*extra: str, **kwargs) -> ServiceProcess:
        return service_factory("memsvc", *SMALL_POOL, *extra, **kwargs)

    return factory


@pytest.fixture
def memsvc(memsvc_factory) -> ServiceProcess:
    return memsvc_factory()


# The tiny model's geometry (4 layers, 2 KV heads of 64), for memsvc pools that serve it.
TINY_MODEL_POOL = ["--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64"]


@dataclass
class Stack:
    memsvc: ServiceProcess
    model: ServiceProcess
    scheduler: ServiceProcess


def start_stack(
    service_factory,
    checkpoint: Path,
    pool: list[str],
    scheduler: list[str] = (),
    *,
    name: str = "",
    env: dict[str, str] | None = None,
) -> Stack:
    """memsvc + model_svc + scheduler_svc (normal mode), wired together."""
    mem = service_factory("memsvc", *TINY_MODEL_POOL, *pool, name=f"memsvc{name}")
    model = service_factory(
        "model_svc",
        "--memsvc",
        mem.address,
        "--checkpoint",
        str(checkpoint),
        "--threads",
        "1",
        name=f"model_svc{name}",
    )
    sched = service_factory(
        "scheduler_svc",
        "--memsvc",
        mem.address,
        "--worker",
        model.address,
        *scheduler,
        name=f"scheduler_svc{name}",
        env=env,
    )
    return Stack(mem, model, sched)
