"""Start real memsvc processes for tests, and always reap them."""

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

REPO = Path(__file__).resolve().parents[2]
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
class MemsvcProcess:
    proc: subprocess.Popen
    address: str
    epoch: str
    ready_file: Path
    metrics_port: int | None
    log_path: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
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


def start_memsvc(
    tmp_path: Path, *extra: str, name: str = "memsvc", address: str | None = None
) -> MemsvcProcess:
    address = address or f"ipc://{tmp_path}/{name}.sock"
    ready = tmp_path / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = tmp_path / f"{name}.log"
    args = [
        sys.executable,
        "-m",
        "memsvc",
        "--listen",
        address,
        "--ready-file",
        str(ready),
        *SMALL_POOL,
        *extra,
    ]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"memsvc did not start:\n{log_path.read_text()}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    return MemsvcProcess(proc, address, info["epoch"], ready, info["metrics_port"], log_path)


@pytest.fixture
def memsvc_factory(tmp_path: Path) -> Iterator:
    """Start memsvc processes; every one is stopped (and killed if need be) after the test."""
    started: list[MemsvcProcess] = []

    def factory(*extra: str, **kwargs) -> MemsvcProcess:
        svc = start_memsvc(tmp_path, *extra, **kwargs)
        started.append(svc)
        return svc

    yield factory
    for svc in started:
        svc.stop()


@pytest.fixture
def memsvc(memsvc_factory) -> MemsvcProcess:
    return memsvc_factory()
