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


def test_pd_decode_moves_victims_to_its_peer_with_their_window(
    launcher, swa_checkpoints, growing_oracle
) -> None:
    """Issue 32, part 2, on a hybrid pool: the small decode node D1 moves its retracted
    requests (full KV and the window's SWA KV, from its host store) to the roomy D2
    (``--migrate-policy always``), which decodes on; outputs equal transformers'.
    Before: a hybrid pool's host entry could not be sent, and D1 turned migration off."""
    up = launcher.start_pd_stack(
        swa_checkpoints["hybrid"],
        POOL,
        ["--num-reserved-decode-tokens", "8"],
        decode_pool=SMALL_DECODE,
        decode_scheduler=["--schedule-conservativeness", "0.3", "--migrate-policy", "always"],
        migrate_to_pool=[],
        transfer_backend="nixl",
        suffix="-moves",
    )
    got = run_all(up["router"].address, "growing")
    mine, want = outputs(got, growing_oracle["hybrid"])
    assert mine == want
    with GenerateClient(up["router"].address) as client:
        d1 = client.info()["stats"]
    with GenerateClient(up["scheduler-d2"].address) as client:
        d2 = client.info()["stats"]
    assert d1["retracted_reqs"] > 0, "the small decode pool should force retracts"
    assert d1["migrated_out_reqs"] > 0 and d1["migrate_failed"] == 0, d1
    assert d2["migrated_in_reqs"] == d1["migrated_out_reqs"], (d1, d2)
    assert d1["reprefilled_tokens"] == 0 and d2["prefill_tokens"] == 0
    for node in ("p", "d", "d2"):
        with MemClient(up[f"memsvc-{node}"].address) as mem:
            mem.check(idle=True)
            assert mem.stats()["host_store_entries"] == 0
