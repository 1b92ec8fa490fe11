"""SGLang's router, SMG (the ``smg`` package, 1.13.0), unmodified, in front of kvstack nodes.

:func:`start_smg` starts ``smg launch`` on free loopback ports (its Prometheus port too:
its default, 29000, would collide between tests) and waits until it reports every
worker it was given healthy and ready (``GET /workers``); :meth:`Smg.stop` always
reaps it (SIGTERM, then SIGKILL). SMG dies with the test process even if that
process dies first (``PR_SET_PDEATHSIG``).

Needs the ``cluster`` extra (``smg``): skipped with the reason when it is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.mooncake_master import _die_with_parent, free_port

SMG_VERSION = "1.13.0"


def smg_binary() -> str:
    here = Path(sys.executable).parent / "smg"
    found = str(here) if here.exists() else shutil.which("smg")
    if found is None:
        pytest.skip("smg (SGLang's router) is not installed (the cluster extra)")
    return found


@dataclass
class Smg:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def workers(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/workers", timeout=5) as response:
            return json.load(response)["workers"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)  # it drains, then keeps its listener 5 s
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_smg(workdir: Path, *route_args: str, num_workers: int, timeout: float = 60) -> Smg:
    """``smg launch`` with ``route_args`` (``--worker-urls ...``, or PD mode's flags), once
    ``num_workers`` workers are healthy and ready; health checked every second."""
    port = free_port()
    log_path = workdir / f"smg-{port}.log"
    argv = [
        smg_binary(),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--health-check-interval-secs",
        "1",
        "--log-level",
        "info",
        *route_args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
    smg = Smg(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            workers = smg.workers()
            ready = [w for w in workers if w.get("is_healthy") and w.get("status") == "ready"]
            if len(ready) >= num_workers:
                return smg
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            smg.stop()
            pytest.fail(f"smg did not register {num_workers} workers:\n{smg.log()[-4000:]}")
        time.sleep(0.2)
