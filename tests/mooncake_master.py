"""A Mooncake master on loopback for tests: started on free ports, always stopped.

``mooncake_master`` (module scope) is one master for a test module;
``mooncake_config`` (per test) writes a JSON config for it (SGLang's keys, a tag of
the test's own so no test sees another's pages) and points
``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` at it, so ``--hicache-storage-backend
mooncake`` finds it as SGLang's backend would. A test that kills a master starts its
own (:func:`start_master`). The master dies with the test process even if that
process dies first (``PR_SET_PDEATHSIG``).

Needs the ``cluster`` extra (``mooncake-transfer-engine-non-cuda``, which ``make test``
installs with ``libibverbs1``): skipped with the reason when the wheel is not
installed; a wheel that cannot load (``libibverbs.so.1`` missing) fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PR_SET_PDEATHSIG = 1


def require_mooncake() -> None:
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed (the cluster extra)")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the mooncake wheel does not load (apt-get install libibverbs1?): {exc}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it


def _die_with_parent() -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class MooncakeMaster:
    """One ``mooncake_master`` process on 127.0.0.1 (RPC and metrics ports free ones)."""

    def __init__(self, log_dir: Path) -> None:
        import mooncake

        binary = Path(mooncake.__file__).parent / "mooncake_master"
        self.rpc_port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"
        self.log_path = log_dir / f"mooncake_master-{self.rpc_port}.log"
        self.argv = [
            str(binary),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_ready(10.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited {self.proc.returncode}: "
                    f"{self.log_path.read_text(errors='replace')[-2000:]}"
                )
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.rpc_port), 0.2).close()
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not listen on {self.address} in {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL, as a crash would, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s; reaped either way."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(10)

    def config(self, tag: str, **extra) -> dict:
        """SGLang's mooncake config for this master (a small segment: tests are small)."""
        return {
            "master_server_address": self.address,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 64 << 20,
            "extra_backend_tag": tag,
            **extra,
        }


@contextlib.contextmanager
def start_master(log_dir: Path) -> Iterator[MooncakeMaster]:
    require_mooncake()
    master = MooncakeMaster(log_dir)
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory) -> Iterator[MooncakeMaster]:
    with start_master(tmp_path_factory.mktemp("mooncake")) as master:
        yield master


def tag_of(request) -> str:
    return "t" + hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()


@pytest.fixture
def mooncake_config(mooncake_master, tmp_path, monkeypatch, request) -> dict:
    """The test's mooncake config, in the file SGLANG_HICACHE_MOONCAKE_CONFIG_PATH names."""
    config = mooncake_master.config(tag_of(request))
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    for name in ("MOONCAKE_MASTER", "MOONCAKE_PROTOCOL", "MOONCAKE_GLOBAL_SEGMENT_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return config


__all__ = ["MooncakeMaster", "mooncake_config", "mooncake_master", "start_master"]
