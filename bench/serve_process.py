"""``kvstack serve`` as a child of a bench script: started, waited for, always stopped.

Shared by ``bench/front_attack.py`` and ``bench/serving.py`` (each imports it as
a sibling: a bench script runs with ``bench/`` first on its path).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvstack.stack.process import REPO, Service

STOP_TIMEOUT_S = 60.0  # after SIGTERM, before SIGKILL


@contextlib.contextmanager
def kvstack_serve(
    workdir: Path,
    flags: list[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[Service]:
    """``kvstack serve --port 0 --ready-file F *flags`` until the block ends.

    Its log is ``workdir/serve.log``. Yields it once it has written its ready file
    (``.info`` is that file, ``.address`` its URL, ``.proc`` the process); a
    :class:`RuntimeError` with its log if it exits first or is not ready within
    ``timeout_s``. At the end, also on an error: SIGTERM, SIGKILL after
    :data:`STOP_TIMEOUT_S`, reaped (:meth:`Service.stop`).
    """
    ready = workdir / "serve.ready"
    log_path = workdir / "serve.log"
    command = [sys.executable, "-m", "kvstack", "serve", "--port", "0", "--ready-file", str(ready)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            preexec_fn=preexec_fn,
        )
    service = Service("kvstack-serve", proc, "", {}, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvstack serve did not start:\n{service.log()}")
            time.sleep(0.1)
        service.info = json.loads(ready.read_text())
        service.address = service.info["address"]
        yield service
    finally:
        service.stop(timeout=STOP_TIMEOUT_S)
