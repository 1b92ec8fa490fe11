"""Start real service processes for tests, and always reap them (fixtures in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstack.stack.launch import REPO, Launcher, Service, start_service

__all__ = ["REPO", "SMALL_POOL", "Stack", "start_memsvc", "start_service", "start_stack"]

ServiceProcess = MemsvcProcess = Service
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


def start_memsvc(
    tmp_path: Path, *extra: str, name: str = "memsvc", address: str | None = None
) -> Service:
    return start_service(tmp_path, "memsvc", *SMALL_POOL, *extra, name=name, address=address)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny model, written once for every test that starts a model_svc."""
    from model_svc.tiny import write_tiny_checkpoint  # imports torch: only when used

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Starts service processes; all are stopped (killed if need be) after the test, last first."""
    with Launcher(tmp_path) as started:
        yield started
    # The launcher unlinks what a stopped service left; that it had to is a leak.
    assert not started.leaked_segments, f"services left shm segments: {started.leaked_segments}"


@pytest.fixture
def service_factory(launcher: Launcher):
    return launcher.start


@pytest.fixture
def memsvc_factory(service_factory) -> Iterator:
    """Start memsvc processes (small pool by default, extra flags override)."""

    def factory(*extra: str, **kwargs) -> Service:
        return service_factory("memsvc", *SMALL_POOL, *extra, **kwargs)

    return factory


@pytest.fixture
def memsvc(memsvc_factory) -> Service:
    return memsvc_factory()


@dataclass
class Stack:
    memsvc: Service
    model: Service
    scheduler: Service


def start_stack(
    launcher: Launcher,
    checkpoint: Path,
    pool: list[str],
    scheduler: list[str] = (),
    *,
    name: str = "",
    env: dict[str, str] | None = None,
) -> Stack:
    """memsvc + model_svc + scheduler_svc (normal mode), stopped with the launcher."""
    return Stack(*launcher.start_normal_stack(checkpoint, pool, scheduler, suffix=name, env=env))
