"""The model service over memsvc's hybrid (two-pool) pool: bound as the service binds it,
greedy tokens through its ops equal transformers', and a pool that windows other layers
(or with another window) than the model is refused when the service binds it."""

from __future__ import annotations

import pytest

from memsvc import protocol as wire
from model_svc.client import _Ops, _result
from model_svc.errors import ModelLayoutError
from model_svc.handlers import AttachedPool, ModelService
from tests.model.swa_oracle import FULL, KINDS, SLIDING, WINDOW, hf_greedy, prompt

NUM_NEW = 40


class InProcess(_Ops):
    """model_svc's client ops, answered by a ModelService in this process."""

    def __init__(self, service: ModelService) -> None:
        self.service = service

    def _invoke(self, header, arrays):
        return _result(wire.unpack(self.service.handle(wire.pack({**header, "op_id": 1}, arrays))))


@pytest.mark.parametrize("kind", KINDS)
def test_the_service_runs_memsvc_two_pools(swa_bound_pool, hf_swa_models, kind: str) -> None:
    bp = swa_bound_pool(kind, 16, "memsvc")
    client = InProcess(ModelService(bp.model, lambda: AttachedPool("epoch", bp.attached)))
    assert bp.model._pool.full_to_swa_page is not None  # the two-pool layout
    ids = prompt(70, 7)
    bp.pool.open_request("r")
    assert bp.pool.alloc_extend([("r", len(ids))]) is not None
    row = bp.pool.request("r").row
    out = [int(client.extend([(row, 0, ids)]).next_token_ids[0])]
    while len(out) < NUM_NEW:
        assert bp.pool.alloc_decode(["r"]) is not None
        seq_len = bp.pool.request("r").kv_len
        out.append(int(client.decode([row], [seq_len], out[-1:]).next_token_ids[0]))
    assert out == hf_greedy(hf_swa_models[kind], ids, NUM_NEW)
    assert bp.pool.swa_held_size() <= WINDOW + 2 * 16 < len(ids) + NUM_NEW
    bp.pool.release("r", is_insert=False)
    bp.pool.check_integrity(idle=True)


@pytest.mark.parametrize(
    "change", [{"sliding_window": WINDOW + 1}, {"layer_types": (FULL,) + (SLIDING,) * 5}]
)
def test_the_service_refuses_a_pool_windowed_otherwise(swa_bound_pool, change: dict) -> None:
    bp = swa_bound_pool("hybrid", 16, "memsvc", **change)
    with pytest.raises(ModelLayoutError, match="are not the model's"):
        ModelService(bp.model, lambda: AttachedPool("epoch", bp.attached))
    bp.pool.check_integrity(idle=True)
