"""``kvstack serve`` started by a parent that sets KVSTACK_PARENT (a test, a launcher) dies
with it, and takes its services along, even when that parent is SIGKILLed."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.procs import REPO, kill_parent_of_stack, kill_processes, processes_with, wait_for

# The parent: starts serve as the test fixtures do (memsvc.lifeline.child_env), then waits.
PARENT = """
import os, subprocess, sys, time
from memsvc.lifeline import child_env
ready, checkpoint = sys.argv[1:]
subprocess.Popen(
    [sys.executable, "-m", "kvstack.cli", "serve", "--port", "0", "--ready-file", ready,
     "--model-path", checkpoint, "--num-pages", "64", "--page-size", "4",
     "--max-context-len", "256", "--log-level", "WARNING"],
    env={**os.environ, **child_env()},
)
time.sleep(3600)
"""


def test_a_serve_whose_parent_is_killed_stops_its_stack(tmp_path_factory, checkpoint) -> None:
    tmp = tmp_path_factory.mktemp("serve-parent")  # in every command line below it, only there
    ready = tmp / "serve.ready"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(ready), str(checkpoint)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)},
    )
    try:
        wait_for(ready.exists, 300, "kvstack serve to be ready")
        kill_parent_of_stack(parent, tmp, 90)
    finally:
        parent.kill()
        parent.wait()
        kill_processes(list(processes_with(str(tmp))))
