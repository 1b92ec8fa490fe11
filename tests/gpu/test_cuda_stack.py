"""The three processes on the GPU backend: memsvc ``--backend cuda``, model_svc ``--device cuda``.

The KV pool lives in GPU memory that memsvc allocated and model_svc mapped by
CUDA IPC. Correctness is judged by tokens, as on the CPU: the stack's greedy
outputs equal the dense reference, and outputs with retracts (normal mode,
both retract modes; PD mode, both transfer backends) equal those without.
Skipped, saying why, without a GPU and a CUDA build of torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from memsvc.client import MemClient
from scheduler_svc.client import GenerateClient
from tests.gpu.support import needs_gpu_torch
from tests.scheduler_service.test_normal_mode import (
    finish_ids,
    reference_run,
    run_all,
    workload,
)

pytestmark = [pytest.mark.gpu, needs_gpu_torch]

CUDA_POOL = ["--backend", "cuda", "--page-size", "4", "--max-context-len", "1024"]
BIG = [*CUDA_POOL, "--num-pages", "2048", "--max-running-requests", "32"]
SMALL = [*CUDA_POOL, "--num-pages", "64", "--max-running-requests", "32"]  # 256 tokens
CUDA_MODEL = ["--device", "cuda"]
PRESSURE = ["--schedule-conservativeness", "0.3"]


@pytest.fixture(scope="module")
def reference(checkpoint) -> Iterator[dict]:
    """Outputs of the workload on a GPU pool with no pressure."""
    reqs = workload(seed=1, count=6, long_len=200)
    results = reference_run(checkpoint, BIG, reqs, model=CUDA_MODEL)
    yield {"reqs": reqs, "outputs": finish_ids(results)}


def assert_idle(*memsvcs) -> None:
    for service in memsvcs:
        with MemClient(service.address) as mem:
            mem.check(idle=True)


def stats_of(address: str) -> dict:
    with GenerateClient(address) as client:
        return client.info()["stats"]


def test_gpu_stack_matches_the_dense_reference(checkpoint, reference) -> None:
    import torch

    from model_svc.model import LlamaModel
    from model_svc.reference import generate_dense

    model = LlamaModel.from_checkpoint(checkpoint, device="cuda")
    with torch.no_grad():
        for rid, prompt, max_new in reference["reqs"]:
            assert reference["outputs"][rid] == generate_dense(model, prompt, max_new), rid


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_gpu_normal_retract_is_transparent(launcher, checkpoint, reference, mode) -> None:
    mem, _, sched = launcher.start_normal_stack(
        checkpoint,
        SMALL,  # --offload-copy auto: asynchronous copies on the GPU
        [*PRESSURE, "--retract-mode", mode],
        model=CUDA_MODEL,
        suffix=f"-{mode}",
    )
    got = run_all(sched.address, reference["reqs"])
    assert finish_ids(got) == reference["outputs"]
    stats = stats_of(sched.address)
    assert stats["retracted_reqs"] > 0, "the small pool should have forced retracts"
    if mode == "offload":
        assert stats["reprefilled_tokens"] == 0 and stats["offloaded_tokens"] > 0
    assert_idle(mem)


@pytest.mark.parametrize("transfer", ["nixl", "zmq"])
def test_gpu_pd_retract_is_transparent(launcher, checkpoint, reference, transfer) -> None:
    if transfer == "nixl":
        pytest.importorskip("nixl_cu12", reason="GPU PD test: the nixl-cu12 wheel is missing")
    up = launcher.start_pd_stack(
        checkpoint,
        [*CUDA_POOL, "--max-running-requests", "32"],
        ["--num-reserved-decode-tokens", "8"],
        decode_pool=["--num-pages", "64"],
        decode_scheduler=PRESSURE,
        transfer_backend=transfer,
        model=CUDA_MODEL,
        suffix=f"-{transfer}",
    )
    got = run_all(up["router"].address, reference["reqs"])
    assert finish_ids(got) == reference["outputs"]
    stats = stats_of(up["router"].address)
    assert stats["retracted_reqs"] > 0, "the small decode pool should force retracts"
    assert stats["reprefilled_tokens"] == 0
    assert_idle(up["memsvc-p"], up["memsvc-d"])
