"""Starting services (``kvstack.stack.launch``): a failed start says why, and a service
dies with the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstack.stack.launch import Launcher
from kvstack.stack.process import READY_TIMEOUT_S, LaunchError, model_ready_timeout, start_service
from memsvc.client import MemClient
from memsvc.core.backends.shm import list_segments
from tests.procs import REPO, kill_processes, processes_with, wait_for

# Stand-ins for a service that never gets ready: each ignores its flags.
FAKE_SERVICES = {
    "exits_early": "print('bad flag: --nope', flush=True); raise SystemExit(2)",
    "dies_by_signal": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "hangs_quietly": "import time; time.sleep(600)",
    "hangs_loading": "import time; print('loading weights', flush=True); time.sleep(600)",
}


@pytest.fixture
def fake_services(tmp_path: Path) -> dict[str, str]:
    """The modules above in a folder; the ``env`` that makes them importable."""
    folder = tmp_path / "fake"
    folder.mkdir()
    for name, code in FAKE_SERVICES.items():
        (folder / f"{name}.py").write_text(code + "\n")
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}


@pytest.mark.parametrize(
    ("module", "says"),
    [
        ("exits_early", "exits_early exited with code 2 before it was ready; its log "),
        ("dies_by_signal", "dies_by_signal was killed by SIGKILL before it was ready; its log "),
        ("hangs_quietly", "hangs_quietly was still running but not ready after 2s (pid "),
        ("hangs_loading", "hangs_loading was still running but not ready after 2s (pid "),
    ],
)
def test_a_failed_start_says_why(tmp_path, fake_services, module: str, says: str) -> None:
    with pytest.raises(LaunchError) as failed:
        start_service(tmp_path, module, timeout=2, env=fake_services)
    message = str(failed.value)
    assert message.startswith(says), message
    log = tmp_path / f"{module}.log"
    if module in ("exits_early", "hangs_loading"):
        last = "bad flag: --nope" if module == "exits_early" else "loading weights"
        assert message.endswith(f"its log {log} ends:\n{last}"), message
    else:
        assert message.endswith(f"its log {log} is empty"), message
    assert processes_with(str(tmp_path)) == {}  # the hung ones were killed, all reaped


def test_services_started_together_are_reaped_when_one_fails(tmp_path, fake_services) -> None:
    """``Launcher.spawn`` starts services at once (model_svc beside memsvc): when the one
    awaited first fails, the one still starting is killed with the launcher, not left."""
    launcher = Launcher(tmp_path)
    with pytest.raises(LaunchError, match=r"^exits_early exited with code 2"), launcher:
        hung = launcher.spawn("hangs_loading", env=fake_services)
        failed = launcher.spawn("exits_early", env=fake_services)
        assert launcher.starting == [hung, failed]
        launcher.await_started(failed)
    assert hung.proc.returncode is not None and launcher.starting == []
    assert processes_with(str(tmp_path)) == {}


def test_model_svc_gets_longer_to_start_the_bigger_its_checkpoint(tmp_path, checkpoint) -> None:
    assert model_ready_timeout(tmp_path / "missing") == READY_TIMEOUT_S
    assert READY_TIMEOUT_S <= model_ready_timeout(checkpoint) < READY_TIMEOUT_S + 10
    with open(tmp_path / "model.safetensors", "wb") as weights:  # SmolLM2-135M's size
        weights.truncate(540_000_000)  # sparse: no disk used
    assert model_ready_timeout(tmp_path) >= READY_TIMEOUT_S + 60


SPAWN_FROM_A_THREAD = """
    import os, sys, threading
    from pathlib import Path
    from tests.procs import start_memsvc, wait_for
    started = []
    spawner = threading.Thread(target=lambda: started.append(start_memsvc(Path(sys.argv[1]))))
    spawner.start()
    spawner.join()
    gone = lambda: not os.path.exists(f"/proc/self/task/{spawner.native_id}")
    wait_for(gone, 30, "the spawning thread to exit", 0.01)
    print(started[0].proc.pid, started[0].address, flush=True)
    threading.Event().wait()
"""


def test_a_service_outlives_the_thread_that_started_it_not_the_process(tmp_path) -> None:
    """Linux's parent-death signal fires when the spawning *thread* ends: a launcher used
    from a thread must not lose its services then, but must when its process dies."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SPAWN_FROM_A_THREAD), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    pid = 0
    try:
        pid_text, address = parent.stdout.readline().split()
        pid = int(pid_text)
        with MemClient(address, timeout_s=5.0, retries=0) as mem:
            mem.heartbeat()  # still serving, its spawner gone
        assert len(segments_of(pid)) == 2
        parent.kill()
        parent.wait()
        wait_for(lambda: not processes_with(str(tmp_path)), 30, "memsvc to exit with its parent")
        assert segments_of(pid) == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        kill_processes([pid] if pid else [])


def segments_of(pid: int) -> list[str]:
    return [n for n in list_segments() if n.startswith(f"kvstack-{pid}-")]
