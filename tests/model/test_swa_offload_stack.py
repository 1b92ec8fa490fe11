"""Sliding-window models, retract by offload, end to end (normal mode): memsvc +
model_svc + scheduler_svc as real processes, ``--retract-mode offload`` on a small pool.

A victim's full KV and the SWA KV of its window go to memsvc's host store and come back
into fresh pages (SWA pages for the window only); the greedy outputs equal
transformers' ``generate`` (contexts past 4 x W), with retracts that offloaded and
loaded back and nothing re-prefilled; both pools and the host store check out idle.
"""

from __future__ import annotations

import pytest

from scheduler_svc.client import GenerateClient
from tests.model.swa_oracle import KINDS, hf_greedy
from tests.model.test_swa_stack import SMALL_POOL, check_idle_pools, outputs, requests, run_all
from tests.procs import start_stack


@pytest.fixture(scope="module")
def growing_oracle(hf_swa_models) -> dict[str, dict[str, list[int]]]:
    return {
        kind: {
            rid: hf_greedy(hf_swa_models[kind], ids, new) for rid, ids, new in requests("growing")
        }
        for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
def test_retract_by_offload_gives_transformers_tokens(
    launcher, swa_checkpoints, growing_oracle, kind: str
) -> None:
    stack = start_stack(
        launcher,
        swa_checkpoints[kind],
        SMALL_POOL,
        ["--schedule-conservativeness", "0.3", "--retract-mode", "offload"],
        name=f"-{kind}-offload",
    )
    got = run_all(stack.scheduler.address, "growing")
    mine, want = outputs(got, growing_oracle[kind])
    assert mine == want
    retractions = sum(r.meta_info["num_retractions"] for r in got.values())
    assert retractions > 0, "the small pool should have forced retracts"
    with GenerateClient(stack.scheduler.address) as client:
        stats = client.info()["stats"]
    assert stats["retracted_reqs"] == retractions
    assert stats["offloaded_reqs"] == retractions == stats["loaded_reqs"]
    assert stats["reprefilled_tokens"] == 0  # every victim came back from the host store
    check_idle_pools(stack, hybrid=True)
