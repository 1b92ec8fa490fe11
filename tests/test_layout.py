"""The package layout's import contracts (pyproject.toml, ``[tool.importlinter]``).

``lint-imports`` checks them on the real tree; each contract is also shown to
fail on a copy of the tree with one wrong import added, so a contract that
stopped matching anything could not pass silently.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstack", "scheduler_svc", "model_svc", "memsvc")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

ONE_WAY = "one way: kvstack -> scheduler_svc -> model_svc -> memsvc"
NO_CYCLES = "no import cycles between the modules of a package"
PURE_CORES = "the pure cores do no I/O and know no service"
CORE_GETS_NUMBERS = "the scheduler's core gets numbers from memsvc, not a client"
CONTRACTS = (ONE_WAY, NO_CYCLES, PURE_CORES, CORE_GETS_NUMBERS)


def lint_imports(root: Path) -> tuple[int, dict[str, str]]:
    """Run the contracts over the packages under ``root``: (exit code, {contract: verdict})."""
    proc = subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": str(LINT_IMPORTS.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    verdicts = {}
    for line in proc.stdout.splitlines():
        for name in CONTRACTS:
            if line.startswith(name + " "):
                verdicts[name] = line[len(name) + 1 :].strip()
    return proc.returncode, verdicts


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the four packages, to add a wrong import to."""
    for package in PACKAGES:
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return tmp_path


def append(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_real_tree_keeps_every_contract():
    code, verdicts = lint_imports(REPO)
    assert verdicts == dict.fromkeys(CONTRACTS, "KEPT")
    assert code == 0


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("memsvc.ops", "import kvstack.cli  # noqa", ONE_WAY),
        ("model_svc.config", "from scheduler_svc import client  # noqa", ONE_WAY),
        ("scheduler_svc.engine.loop", "from kvstack.stack import launch  # noqa", ONE_WAY),
        # kvstack.up.status imports health; health importing status closes a cycle
        ("kvstack.up.health", "from kvstack.up import status  # noqa", NO_CYCLES),
        ("memsvc.core.pool", "import zmq  # noqa", PURE_CORES),
        ("scheduler_svc.core.admission", "import asyncio  # noqa", PURE_CORES),
        ("scheduler_svc.core.policy", "from memsvc.core import errors  # noqa", CORE_GETS_NUMBERS),
    ],
)
def test_a_wrong_import_breaks_its_contract(tree, module, line, broken):
    append(tree, module, line)
    code, verdicts = lint_imports(tree)
    assert code != 0
    assert verdicts[broken] == "BROKEN"
    kept = {name for name, verdict in verdicts.items() if verdict == "KEPT"}
    assert kept == set(CONTRACTS) - {broken}


def test_a_back_reference_for_type_hints_only_is_allowed(tree):
    back_reference = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import kvstack.cli"
    append(tree, "memsvc.ops", back_reference)
    code, verdicts = lint_imports(tree)
    assert verdicts == dict.fromkeys(CONTRACTS, "KEPT")
    assert code == 0
