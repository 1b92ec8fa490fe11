"""A hybrid (Ministral) checkpoint's normal-mode stack with the hierarchical cache: real
processes, a small device pool over a host tier. The growing workload runs twice: the
second round's prompts find their KV pushed to the host tier by the first round and
by each other, and come back with their SWA tails; every output equals transformers'
greedy tokens (past 4 x W, with retracts), and the pools check out idle."""

from __future__ import annotations

import pytest

from memsvc.client import MemClient
from tests.model.swa_oracle import hf_greedy
from tests.model.test_swa_stack import SMALL_POOL, check_idle_pools, outputs, requests, run_all
from tests.procs import start_stack

HICACHE = ["--enable-hierarchical-cache", "--hicache-ratio", "4",
           "--hicache-disable-load-cost-model"]  # fmt: skip


@pytest.fixture(scope="module")
def hybrid_oracle(hf_swa_models) -> dict[str, list[int]]:
    return {
        rid: hf_greedy(hf_swa_models["hybrid"], ids, new) for rid, ids, new in requests("growing")
    }


def test_host_hits_with_their_swa_tails_give_transformers_tokens(
    launcher, swa_checkpoints, hybrid_oracle
) -> None:
    stack = start_stack(
        launcher,
        swa_checkpoints["hybrid"],
        [*SMALL_POOL, *HICACHE],
        ["--schedule-conservativeness", "0.3"],
        name="-hybrid-hicache",
    )
    for _ in range(2):
        got = run_all(stack.scheduler.address, "growing")
        mine, want = outputs(got, hybrid_oracle)
        assert mine == want
    with MemClient(stack.memsvc.address) as mem:
        stats = mem.stats()["hicache"]
    assert stats["hit_tokens"]["host"] > 0, stats["hit_tokens"]
    check_idle_pools(stack, hybrid=True)
