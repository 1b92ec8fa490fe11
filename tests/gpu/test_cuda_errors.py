"""Clear errors on the GPU path, checked without a GPU.

Asking for CUDA where there is none, a GPU too small for the pool, an IPC
handle that cannot be opened: each must fail at once with a message that says
what to do. The driver's answers are simulated with the stand-in ``cupy`` of
``fake_cupy.py``, so these run everywhere (CI has no GPU).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from memsvc.core import KVPool
from memsvc.core.backends import attach
from memsvc.core.errors import BackendUnavailableError
from tests.gpu import fake_cupy
from tests.gpu.support import gpu_missing_reason, torch_cuda_missing_reason
from tests.helpers import small_layout
from tests.procs import REPO


def test_no_gpu_says_so(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make(devices=0))
    with pytest.raises(BackendUnavailableError, match=r"no GPU found.*--backend shm"):
        KVPool(small_layout(), backend="cuda")


def test_missing_device_index_says_so(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make(devices=1))
    with pytest.raises(BackendUnavailableError, match="no GPU with index 3"):
        KVPool(small_layout(), backend="cuda", backend_options={"device": 3})


def test_pool_too_big_for_the_gpu_says_what_to_lower(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make(free_bytes=1024))
    with pytest.raises(BackendUnavailableError, match=r"no room for the KV pool.*--num-pages"):
        KVPool(small_layout(), backend="cuda")


def test_ipc_handle_that_cannot_be_opened_names_the_likely_cause(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy.make())
    handle = {
        "backend": "cuda",
        "layout": small_layout().to_dict(),
        "device": 0,
        "kv_ipc": b"\0" * 64,
        "req_to_token_ipc": b"\0" * 64,
    }
    with pytest.raises(BackendUnavailableError, match=r"IPC handle.*ipc: host"):
        attach(handle)


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


def test_memsvc_with_cuda_backend_and_no_gpu_exits_with_a_clear_error(tmp_path) -> None:
    if gpu_missing_reason() is None:
        pytest.skip("a GPU is present; this checks memsvc's error without one")
    layout = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8"]
    proc = run_module(
        "memsvc", *layout, "--backend", "cuda", "--listen", f"ipc://{tmp_path}/m.sock"
    )
    assert proc.returncode == 2, proc.stderr
    assert "memsvc: error: backend 'cuda'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_model_svc_on_cuda_without_cuda_torch_exits_with_a_clear_error(tmp_path) -> None:
    if torch_cuda_missing_reason() is None:
        pytest.skip("torch sees a GPU; this checks model_svc's error without one")
    proc = run_module("model_svc", "--memsvc", f"ipc://{tmp_path}/none.sock", "--device", "cuda")
    assert proc.returncode == 2, proc.stderr
    assert "model_svc: error: --device cuda" in proc.stderr
    assert "Traceback" not in proc.stderr
