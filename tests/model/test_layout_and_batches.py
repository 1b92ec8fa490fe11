"""A pool that does not fit the model, and batches that cannot run, fail with typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from memsvc.core import attach
from model_svc.errors import InvalidBatchError, ModelLayoutError
from model_svc.model import ExtendItem
from tests.model.driver import model_layout


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_layers": 3}, "layers 4"),
        ({"num_kv_heads": 4}, "kv heads 2"),
        ({"head_dim": 32}, "head dim 64"),
        ({"dtype": "float16"}, "dtype torch.float16 differs"),
    ],
)
def test_pool_layout_mismatch(make_pool, tiny_model, overrides: dict, message: str) -> None:
    pool = make_pool(model_layout(tiny_model.config, 16, **overrides))
    with attach(pool.buffers.handle()) as attached, pytest.raises(ModelLayoutError, match=message):
        tiny_model.bind(attached.kv_torch(), attached.req_to_token_torch(), 16)
    pool.check_integrity(idle=True)


def test_page_size_mismatch_and_unbound(make_pool, tiny_model) -> None:
    pool = make_pool(model_layout(tiny_model.config, 16))
    # The right pool, but told the wrong page size.
    with (
        attach(pool.buffers.handle()) as attached,
        pytest.raises(ModelLayoutError, match="page_size 8"),
    ):
        tiny_model.bind(attached.kv_torch(), attached.req_to_token_torch(), 8)
    tiny_model.unbind()
    with pytest.raises(ModelLayoutError, match="no KV pool bound"):
        tiny_model.extend([ExtendItem(1, 0, [1, 2])])
    pool.check_integrity(idle=True)


def test_invalid_batches(bound_pool) -> None:
    bp = bound_pool(4)
    pool, model = bp.pool, bp.model
    row = pool.open_request("a")
    pool.alloc_extend([("a", 5)])
    before = bp.kv_snapshot()
    bad_extends = {
        "at least one request": [],
        "twice": [ExtendItem(row, 0, [1, 2]), ExtendItem(row, 2, [3])],
        "token ids must be in": [ExtendItem(row, 0, [1, 259])],
        "rows must be in": [ExtendItem(0, 0, [1])],
        "without a KV slot": [ExtendItem(row, 3, [1, 2, 3])],  # positions 5..: never allocated
        "needs prefix_len >= 0 and new tokens": [ExtendItem(row, 5, [])],
        "exceed req_to_token width": [ExtendItem(row, 510, [1, 2, 3])],
    }
    for message, items in bad_extends.items():
        with pytest.raises(InvalidBatchError, match=message):
            model.extend(items)
    with pytest.raises(InvalidBatchError, match="equally many"):
        model.decode([row], [5, 6], [1])
    with pytest.raises(InvalidBatchError, match="seq_len must be >= 1"):
        model.decode([row], [0], [1])
    with pytest.raises(InvalidBatchError, match="without a KV slot"):
        model.decode(np.array([row]), np.array([6]), [1])
    with pytest.raises(InvalidBatchError, match="1-D array of ints"):
        model.decode([row], [5.0], [1])
    # Nothing ran, so nothing was written.
    assert np.array_equal(before, bp.kv_snapshot())
    pool.release("a", is_insert=False)
    pool.check_integrity(idle=True)
