"""Fixtures for the model tests: one tiny checkpoint and model per session, bound pools."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from memsvc.core import KVPool
from model_svc.model import LlamaModel
from model_svc.tiny import write_tiny_checkpoint
from tests.model.driver import BoundPool, model_layout


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One thread, not two: every op here is tiny, and on a 2-core box where anything
    else is busy, each two-thread op waits a scheduler slice for its second thread
    (measured: 5 s on one thread vs 33 s on two for the paged tests, one core busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint: Path) -> LlamaModel:
    return LlamaModel.from_checkpoint(tiny_checkpoint)


@pytest.fixture
def bound_pool(
    make_pool: Callable[..., KVPool], tiny_model: LlamaModel
) -> Iterator[Callable[..., BoundPool]]:
    """Factory: a float32 pool fitting the tiny model, attached and bound to it.

    The model is unbound and the attachment closed before ``make_pool`` closes the pool.
    """
    bound: list[BoundPool] = []

    def factory(page_size: int, *, host_store_bytes: int = 0, **layout_overrides: int) -> BoundPool:
        layout = model_layout(tiny_model.config, page_size, **layout_overrides)
        pool = make_pool(layout, host_store_bytes=host_store_bytes)
        bound.append(BoundPool.attach(pool, tiny_model))
        return bound[-1]

    yield factory
    for item in bound:
        item.close()
