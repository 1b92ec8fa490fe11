"""model_svc's entry point: it waits for memsvc's ready file, and exits without torch's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from model_svc.__main__ import await_ready_file
from model_svc.errors import ModelSvcError
from tests.procs import REPO

EXIT_NOW = """
import atexit, logging, sys
from model_svc.__main__ import exit_now
atexit.register(lambda: print("exit handler ran", flush=True))
logging.basicConfig(stream=sys.stderr)
logging.getLogger("t").warning("logged before the exit")
print("buffered, not flushed", end="")
exit_now(3)
print("never")
"""


def test_exit_now_runs_the_exit_handlers_and_flushes_then_exits_with_the_code() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXIT_NOW],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, not flushedexit handler ran\n"
    assert "logged before the exit" in done.stderr


def test_await_ready_file_returns_once_memsvc_has_written_it(tmp_path) -> None:
    ready = tmp_path / "memsvc.ready"
    writer = threading.Timer(0.3, ready.write_text, args=('{"address": "ipc://x"}',))
    started = time.monotonic()
    writer.start()
    try:
        await_ready_file(str(ready), timeout_s=30)
    finally:
        writer.join()
    assert ready.exists() and 0.25 < time.monotonic() - started < 30


def test_await_ready_file_gives_up_after_its_timeout(tmp_path) -> None:
    missing = tmp_path / "memsvc.ready"
    with pytest.raises(ModelSvcError, match=f"memsvc wrote no ready file {missing} within 0.2s"):
        await_ready_file(str(missing), timeout_s=0.2)


LOAD_THEN_LIST = """
import sys
from model_svc.model import LlamaModel
LlamaModel.from_checkpoint(sys.argv[1])
print("imported:", [m for m in ("torch._dynamo", "sympy") if m in sys.modules])
"""


def test_loading_a_model_does_not_import_torch_dynamo(checkpoint) -> None:
    """Built on the meta device, a model's random init would import torch._dynamo (and
    sympy): about a CPU-second of every model_svc start, for weights overwritten at once."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_THEN_LIST, str(checkpoint)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "imported: []", done.stdout + done.stderr
