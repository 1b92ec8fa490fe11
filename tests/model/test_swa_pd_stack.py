"""Sliding-window models in PD mode end to end: router, prefill node, decode node (real
processes, the pools' layer types read from the checkpoint by the launcher).

The prompt's KV crosses by NIXL (every page's full KV, the SWA KV of its window alone);
the decode node's small pool retracts by offloading to its host store (full KV and the
window's SWA KV) and resumes from there. Greedy outputs equal transformers' ``generate``
past 4 x W; both nodes' pools and host stores check out idle.
"""

from __future__ import annotations

import pytest

from memsvc.client import MemClient
from scheduler_svc.client import GenerateClient
from tests.model.swa_oracle import KINDS, hf_greedy
from tests.model.test_swa_stack import PAGE, outputs, requests, run_all

POOL = [*PAGE, "--num-pages", "1024", "--max-running-requests", "16"]
SMALL_DECODE = ["--num-pages", "64"]  # two pools in the bytes of 256 tokens of every layer


@pytest.fixture(scope="module")
def growing_oracle(hf_swa_models) -> dict[str, dict[str, list[int]]]:
    return {
        kind: {
            rid: hf_greedy(hf_swa_models[kind], ids, new) for rid, ids, new in requests("growing")
        }
        for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
def test_pd_decode_retracts_by_offload_and_resumes(
    launcher, swa_checkpoints, growing_oracle, kind: str
) -> None:
    up = launcher.start_pd_stack(
        swa_checkpoints[kind],
        POOL,
        ["--num-reserved-decode-tokens", "8"],
        decode_pool=[*SMALL_DECODE, "--offload-copy", "async"],
        decode_scheduler=["--schedule-conservativeness", "0.3"],
        transfer_backend="nixl",
        suffix=f"-{kind}",
    )
    for node in ("p", "d"):
        with MemClient(up[f"memsvc-{node}"].address) as mem:
            assert mem.layout.is_hybrid, node
    got = run_all(up["router"].address, "growing")
    mine, want = outputs(got, growing_oracle[kind])
    assert mine == want
    with GenerateClient(up["router"].address) as client:
        state = client.info()
    stats = state["stats"]
    assert stats["retracted_reqs"] > 0, "the small decode pool should force retracts"
    assert stats["offloaded_reqs"] == stats["retracted_reqs"] == stats["loaded_reqs"]
    assert stats["reprefilled_tokens"] == 0 and stats["aborted_reqs"] == 0
    assert sum(r.meta_info["num_retractions"] for r in got.values()) == stats["retracted_reqs"]
    # the prefill node computed each prompt once: the victims came back from the host store
    assert state["prefill"]["stats"]["prefill_tokens"] == sum(
        len(ids) for _, ids, _ in requests("growing")
    )
    for node in ("p", "d"):
        with MemClient(up[f"memsvc-{node}"].address) as mem:
            mem.check(idle=True)  # both pools, both host-store arenas
            assert mem.stats()["host_store_entries"] == 0
