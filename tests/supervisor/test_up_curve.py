"""``kvstack up --curve-dir``: a stack with CURVE on every socket, as a user runs it.

The keys are created in the folder (private), every process serves and
connects with them, the supervisor's and ``kvstack status``'s health checks
use them, a client with them gets its tokens, and each socket of the stack
(memsvc, model_svc, scheduler_svc) refuses a peer without keys and one with
a key it does not accept.
"""

from __future__ import annotations

import signal
import stat
from functools import partial
from pathlib import Path

import pytest
import zmq.auth

from kvstack.up.health import check
from memsvc.curve import CurveClientKeys, KeyFolder
from scheduler_svc.client import GenerateClient
from tests.procs import at_once
from tests.supervisor.test_supervisor import POOL, kvstack, run_dir, up, wait_for

__all__ = ["run_dir", "up"]  # the fixtures, shared with test_supervisor

pytestmark = pytest.mark.timeout(600)

REFUSED_WITHIN_S = 1.0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_refused_without_the_keys(
    services: list[tuple[str, str]], stranger: CurveClientKeys
) -> None:
    """Each (kind, address) refuses a client without keys and one with ``stranger``'s;
    each refusal waits out its timeout, so the probes go together (at_once)."""
    probes = [(kind, address, curve) for kind, address in services for curve in (None, stranger)]
    answers = at_once([partial(check, k, a, REFUSED_WITHIN_S, c) for k, a, c in probes])
    for (kind, _, _), (healthy, detail) in zip(probes, answers, strict=True):
        assert not healthy, f"{kind} answered a client without the stack's keys: {detail}"


def test_up_with_curve_on_every_socket(up, run_dir: Path, tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    stack = up("--mode", "normal", *POOL, "--curve-dir", str(keys_dir), "--health-interval", "1")
    state = wait_for(stack.healthy, 240, f"a healthy CURVE stack:\n{stack.output()}")
    assert state["curve_dir"] == str(keys_dir.resolve())
    assert "CURVE" in stack.output()

    keys = KeyFolder.existing(keys_dir)
    assert mode(keys_dir) == 0o700 and mode(keys.clients) == 0o700
    assert mode(keys.server_secret) == 0o600 and mode(keys.client_secret) == 0o600
    status = kvstack("status", "--run-dir", str(run_dir))
    assert status.returncode == 0, status.stdout + status.stderr  # it pinged with the keys

    procs = {p["name"]: p for p in state["processes"]}
    scheduler = procs["scheduler_svc"]["address"]
    with GenerateClient(scheduler, timeout_s=60, curve=keys.client_keys()) as client:
        result = client.generate(
            list(range(3, 40)), sampling={"max_new_tokens": 16, "ignore_eos": True}
        )
    assert len(result.output_ids) == 16

    _, stranger_secret = zmq.auth.create_certificates(tmp_path, "stranger")
    stranger = CurveClientKeys.from_files(keys.server_public, stranger_secret)
    names = ("memsvc", "model_svc", "scheduler_svc")
    assert_refused_without_the_keys(
        [(procs[n]["kind"], procs[n]["address"]) for n in names], stranger
    )

    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(120) == 0, stack.output()
    assert keys.server_secret.exists()  # the keys outlive the stack: the next one reuses them
