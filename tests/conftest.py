"""Shared fixtures: pools that are always closed, and a shared-memory leak guard."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest

from kvstack.up.cli import pid_alive
from memsvc.core import KVPool, PoolLayout
from memsvc.core.backends.shm import SHM_DIR, list_segments, segment_owner_pid
from tests.helpers import small_layout
from tests.mooncake_master import (  # noqa: F401
    mooncake_config,
    mooncake_master,
)
from tests.procs import (  # noqa: F401
    checkpoint,
    launcher,
    memsvc,
    memsvc_factory,
    service_factory,
)
from tests.smollm2 import (  # noqa: F401
    download_dir,
    hf_greedy,
    hf_tokenizer,
    prompts,
    remove_shared,
    smollm2_checkpoint,
    smollm2_gguf,
    smollm2_home,
)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The SmolLM2 home and answers shared by the run's workers go with the run."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        remove_shared(session.config, factory)


def _unlink(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Unlink any segment this test process leaves behind, then fail the test.

    Only segments named after this process are its own; other processes'
    (a child of this test, or another test run on the machine) are checked
    at the end of the session.
    """
    yield
    mine = [n for n in list_segments() if segment_owner_pid(n) == os.getpid()]
    _unlink(mine)
    assert not mine, f"test left shared-memory segments behind: {mine}"


@pytest.fixture(autouse=True, scope="session")
def no_orphan_segments() -> Iterator[None]:
    """At the end of the run, no segment of a process that has died may remain."""
    before = set(list_segments())
    yield
    orphans = [n for n in set(list_segments()) - before if not pid_alive(segment_owner_pid(n) or 0)]
    _unlink(orphans)
    assert not orphans, f"dead processes left shared-memory segments: {orphans}"


@pytest.fixture
def make_pool() -> Iterator[Callable[..., KVPool]]:
    """Factory for KVPools; every pool is closed (segments unlinked) even if the test fails."""
    pools: list[KVPool] = []

    def factory(layout: PoolLayout | None = None, **kwargs) -> KVPool:
        pool = KVPool(layout or small_layout(), **kwargs)
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        pool.close()
