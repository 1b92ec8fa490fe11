"""PD mode end to end: router, prefill node, decode node, real processes.

Correctness is judged by tokens: greedy outputs through the PD stack (with and
without retracts on the decode node) must equal those of a normal-mode stack.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from memsvc.client import MemClient
from scheduler_svc.client import GenerateClient, GenerateError
from tests.scheduler_service.test_normal_mode import (
    finish_ids,
    reference_runs,
    run_all,
    workload,
)

POOL = ["--page-size", "4", "--max-running-requests", "32", "--max-context-len", "1024"]
BIG = [*POOL, "--num-pages", "2048"]
SMALL_DECODE = ["--num-pages", "64"]  # 256 tokens on the decode node: retracts
PD_SCHEDULER = ["--num-reserved-decode-tokens", "8"]
PRESSURE = ["--schedule-conservativeness", "0.3"]


def growth_workload() -> list[tuple[str, list[int], int]]:
    """Requests that each fit the decode pool alone but outgrow it together.

    Five prompts of ~50 tokens with 100 new tokens each (152 slots apiece at
    the end) on the 256-token decode pool: the budget lets a second one in
    beside the first (2 x 152 - 52 <= 256) and more as the first ones grow,
    and together they need more than the pool, so the decode node retracts.
    """
    rng = random.Random(7)
    return [
        (f"g{i}", [rng.randrange(256) for _ in range(rng.randint(44, 52))], 100) for i in range(5)
    ]


@pytest.fixture(scope="module")
def references(checkpoint) -> tuple[dict, dict]:
    """Normal-mode outputs of the workload and of the growth workload, one after the
    other on one stack whose pool has no pressure."""
    reqs, growth_reqs = workload(seed=1, count=6, long_len=200), growth_workload()
    results, grown = reference_runs(checkpoint, BIG, reqs, growth_reqs)
    return (
        {"reqs": reqs, "outputs": finish_ids(results), "results": results},
        {"reqs": growth_reqs, "outputs": finish_ids(grown)},
    )


@pytest.fixture(scope="module")
def reference(references) -> dict:
    """Normal-mode outputs of the workload on a pool with no pressure."""
    return references[0]


@pytest.fixture(scope="module")
def growth(references) -> dict:
    """Normal-mode outputs of :func:`growth_workload` on a pool with no pressure."""
    return references[1]


def idle_check(*memsvcs) -> None:
    for service in memsvcs:
        with MemClient(service.address) as mem:
            mem.check(idle=True)  # no page leaked, host store empty
            assert mem.stats()["host_store_entries"] == 0


def info(router) -> dict:
    with GenerateClient(router.address) as client:
        return client.info()


def test_pd_outputs_equal_normal_mode_without_pressure(launcher, checkpoint, reference):
    up = launcher.start_pd_stack(checkpoint, BIG, PD_SCHEDULER, transfer_backend="zmq")
    got = run_all(up["router"].address, reference["reqs"])
    assert finish_ids(got) == reference["outputs"]
    assert [r.finish_reason for r in got.values()] == [
        r.finish_reason for r in reference["results"].values()
    ]
    stats = info(up["router"])
    assert stats["mode"] == "pd" and stats["stats"]["retracted_reqs"] == 0
    assert stats["stats"]["prefill_tokens"] == 0  # the decode node computes no prefill
    idle_check(up["memsvc-p"], up["memsvc-d"])
    check_sglang_generate_through_the_router(up, reference)


def check_sglang_generate_through_the_router(up, reference) -> None:
    """On the same stack: streamed meta_info and stop strings pass the router,
    return_logprob is refused (400, named), flush_cache flushes both nodes."""
    rid, prompt, _ = reference["reqs"][1]
    want = reference["outputs"][rid]
    with GenerateClient(up["router"].address, timeout_s=120) as client:
        items = list(client.stream(prompt, sampling={"max_new_tokens": 12, "ignore_eos": True}))
        chunks = items[:-1]
        assert chunks and items[-1].output_ids == want[:12]
        for chunk in chunks:
            meta = chunk.meta_info
            assert meta["prompt_tokens"] == len(prompt)
            assert meta["completion_tokens"] == chunk.offset + len(chunk.token_ids)
        # A stop token id in the middle of the output ends it there, as in normal mode.
        stop = want[4]
        got = client.generate(prompt, sampling={"max_new_tokens": 12, "stop_token_ids": [stop]})
        assert got.output_ids == want[: want.index(stop) + 1]
        with pytest.raises(GenerateError, match="return_logprob") as err:
            client.generate(prompt, return_logprob=True)
        assert err.value.status_code == 400
        flushed, message = client.flush_cache()
        assert flushed, message
        assert "prefill:" in message and "decode:" in message
    for name in ("memsvc-p", "memsvc-d"):
        with MemClient(up[name].address) as mem:
            mem.heartbeat()
            assert mem.sizes.evictable == 0, name
    idle_check(up["memsvc-p"], up["memsvc-d"])


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_decode_pressure_retracts_by_offload_and_resumes_locally(
    launcher, checkpoint, growth, overlap
):
    """Token-identical to normal mode without pressure, with the overlap schedule on
    (the default) and off (``--disable-overlap-schedule``)."""
    off = ["--disable-overlap-schedule"] if overlap == "off" else []
    up = launcher.start_pd_stack(
        checkpoint,
        POOL,
        PD_SCHEDULER,
        # asynchronous offload copies, as on a GPU: freed pages wait for their copy
        decode_pool=[*SMALL_DECODE, "--offload-copy", "async"],
        decode_scheduler=[*PRESSURE, *off],
        transfer_backend="nixl",
    )
    reqs = growth["reqs"]
    got = run_all(up["router"].address, reqs)
    assert finish_ids(got) == growth["outputs"]
    state = info(up["router"])
    stats = state["stats"]
    assert stats["retracted_reqs"] > 0, "the small decode pool should force retracts"
    assert stats["offloaded_reqs"] == stats["retracted_reqs"] == stats["loaded_reqs"]
    assert stats["reprefilled_tokens"] == 0 and stats["aborted_reqs"] == 0
    assert (stats["reserved_ahead_steps"] > 0) is (overlap == "on")
    # The prefill node computed each prompt once: nothing for the retracted requests.
    assert state["prefill"]["stats"]["prefill_tokens"] == sum(len(p) for _, p, _ in reqs)
    # While a request was parked in the host store, no new preallocation started.
    parked: set[str] = set()
    for _, kind, rid in state["timeline"]:
        if kind == "retract":
            parked.add(rid)
        elif kind == "resume":
            parked.discard(rid)
        elif kind == "prealloc":
            assert not parked, f"preallocated {rid} while {parked} were retracted"
    assert sum(r.meta_info["num_retractions"] for r in got.values()) == stats["retracted_reqs"]
    idle_check(up["memsvc-p"], up["memsvc-d"])


@pytest.mark.parametrize("fallback", ["abort", "recompute"])
def test_host_store_full(launcher, checkpoint, growth, fallback):
    up = launcher.start_pd_stack(
        checkpoint,
        POOL,
        PD_SCHEDULER,
        decode_pool=[*SMALL_DECODE, "--host-store-bytes", "0"],
        decode_scheduler=[*PRESSURE, "--pd-retract-fallback", fallback],
        transfer_backend="zmq",
    )
    got = run_all(up["router"].address, growth["reqs"])
    stats = info(up["router"])["stats"]
    assert stats["retracted_reqs"] > 0, "the small decode pool should force retracts"
    aborted = {rid for rid, r in got.items() if r.finish_reason.get("type") == "abort"}
    if fallback == "abort":
        assert aborted and stats["host_full_aborts"] == len(aborted)
        for rid in aborted:
            assert "host store has no room" in got[rid].finish_reason["message"]
            assert got[rid].finish_reason["status_code"] == 500
            want = growth["outputs"][rid]
            assert got[rid].output_ids == want[: len(got[rid].output_ids)]  # partial output
        for rid in set(got) - aborted:
            assert got[rid].output_ids == growth["outputs"][rid]
    else:
        assert not aborted and stats["rebootstraps"] > 0
        assert finish_ids(got) == growth["outputs"]
    idle_check(up["memsvc-p"], up["memsvc-d"])


def test_prefill_node_killed_during_transfer(launcher, checkpoint, reference):
    up = launcher.start_pd_stack(
        checkpoint, BIG, PD_SCHEDULER, transfer_backend="zmq", transfer_timeout=1.0
    )
    # Freeze the prefill node's memsvc so transfers hang, then kill the prefill node.
    up["memsvc-p"].proc.send_signal(signal.SIGSTOP)
    results: dict = {}

    def go() -> None:
        results.update(run_all(up["router"].address, reference["reqs"][1:4]))

    import threading

    thread = threading.Thread(target=go)
    thread.start()
    time.sleep(3)
    for name in ("scheduler-p", "model_svc-p", "memsvc-p"):
        up[name].proc.send_signal(signal.SIGKILL)
        up[name].stop()
    # A SIGKILLed memsvc cannot unlink its pool; the launcher did (as a supervisor would).
    assert up["memsvc-p"].leaked_segments
    up["memsvc-p"].leaked_segments.clear()
    thread.join(120)
    assert not thread.is_alive(), "a request hung after the prefill node died"
    for result in results.values():
        reason = result.finish_reason
        assert reason["type"] == "abort" and reason["status_code"] == 500, reason
        assert "unreachable" in reason["message"]
    idle_check(up["memsvc-d"])
    # The prefill node comes back at the same addresses; the stack serves again.
    listen = f"ipc://{launcher.workdir}/transfer.sock"
    mem = launcher.start(
        "memsvc",
        *up["memsvc-p"].proc.args[up["memsvc-p"].proc.args.index("--num-layers") :],
        name="memsvc-p2",
        address=up["memsvc-p"].address,
    )
    assert listen in mem.proc.args
    model = launcher.start(
        "model_svc",
        "--memsvc",
        mem.address,
        "--checkpoint",
        str(checkpoint),
        name="model_svc-p2",
        address=up["model_svc-p"].address,
    )
    launcher.start(
        "scheduler_svc",
        "--mode",
        "prefill",
        "--memsvc",
        mem.address,
        "--worker",
        model.address,
        *PD_SCHEDULER,
        name="scheduler-p2",
        address=up["scheduler-p"].address,
    )
    again = run_all(up["router"].address, reference["reqs"][4:6])
    assert finish_ids(again) == {rid: reference["outputs"][rid] for rid in again}
    idle_check(mem, up["memsvc-d"])
