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
from tests.model.swa_oracle import (
    KINDS,
    EmulatedTwoPools,
    HybridBound,
    hybrid_layout_fields,
    load_hf,
    write_swa_checkpoint,
)


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


# -- sliding-window models (issue 29): transformers' own, random weights -----------


@pytest.fixture(scope="session")
def swa_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"pure": Mistral folder, "hybrid": Ministral folder}`` (tests/model/swa_oracle.py)."""
    return {
        kind: write_swa_checkpoint(tmp_path_factory.mktemp(f"swa-{kind}"), kind) for kind in KINDS
    }


@pytest.fixture(scope="session")
def swa_models(swa_checkpoints: dict[str, Path]) -> dict[str, LlamaModel]:
    """Our worker's model of each folder."""
    return {kind: LlamaModel.from_checkpoint(path) for kind, path in swa_checkpoints.items()}


@pytest.fixture(scope="session")
def hf_swa_models(swa_checkpoints: dict[str, Path]) -> dict:
    """transformers' model of each folder: the oracle."""
    return {kind: load_hf(path) for kind, path in swa_checkpoints.items()}


@pytest.fixture
def swa_bound_pool(
    make_pool: Callable[..., KVPool], swa_models: dict[str, LlamaModel]
) -> Iterator[Callable[..., BoundPool]]:
    """Factory ``(kind, page_size, layout="one_pool")``: a float32 pool bound to that model.

    ``layout``: "one_pool" (every layer in one pool, today's layout), "emulated" (the
    worker reads the two-pool layout from buffers the test keeps, :class:`EmulatedTwoPools`)
    or "memsvc" (a hybrid KVPool: memsvc's own two pools, :class:`HybridBound`)."""
    bound: list[BoundPool] = []

    def factory(kind: str, page_size: int, layout: str = "one_pool", **overrides) -> BoundPool:
        model = swa_models[kind]
        if layout == "memsvc":
            overrides = hybrid_layout_fields(model.config) | {
                "swa_num_pages": 1024 // page_size,
                **overrides,
            }
        pool = make_pool(model_layout(model.config, page_size, **overrides))
        driver = {"one_pool": BoundPool, "emulated": EmulatedTwoPools, "memsvc": HybridBound}
        bound.append(driver[layout].attach(pool, model))
        return bound[-1]

    yield factory
    for item in bound:
        item.close()
