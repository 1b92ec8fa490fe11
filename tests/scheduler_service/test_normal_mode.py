"""Normal-mode retract, end to end: memsvc + model_svc + scheduler_svc as real processes.

Correctness is judged by tokens: greedy outputs under memory pressure (with
retracts) must equal the outputs of a pool large enough that nothing is
retracted.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvstack.stack.launch import Launcher
from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import MemClient
from memsvc.gcpolicy import THRESHOLDS
from scheduler_svc.client import AsyncGenerateClient, GenerateClient, GenerateError
from scheduler_svc.core import RETRACT_ABORT_MESSAGE
from tests.procs import REPO, Stack, start_stack

PAGE = ["--page-size", "4", "--dtype", "float32", "--max-context-len", "512"]
BIG_POOL = [*PAGE, "--num-pages", "2048", "--max-running-requests", "32"]
SMALL_POOL = [*PAGE, "--num-pages", "64", "--max-running-requests", "32"]  # 256 tokens


def workload(seed: int, count: int, long_len: int = 0) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    if long_len:  # admitted first; the short ones squeeze in beside it
        reqs.append(("long", [rng.randrange(256) for _ in range(long_len)], 40))
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 24))]
        reqs.append((f"r{i}", prompt, rng.randint(8, 40)))
    return reqs


def run_all(address: str, reqs) -> dict[str, object]:
    """Submit everything at once and collect every result."""

    async def go() -> dict[str, object]:
        async with AsyncGenerateClient(address, timeout_s=120) as client:
            results = await asyncio.gather(
                *(
                    client.generate(prompt, rid=rid, sampling={"max_new_tokens": n})
                    for rid, prompt, n in reqs
                )
            )
        return {r.rid: r for r in results}

    return asyncio.run(go())


def finish_ids(results) -> dict[str, list[int]]:
    return {rid: r.output_ids for rid, r in results.items()}


def assert_idle(stack) -> None:
    with MemClient(stack.memsvc.address) as mem:
        mem.check(idle=True)


def reference_runs(checkpoint: Path, pool: list[str], *workloads, **stack_options) -> list:
    """Each of ``workloads`` in turn through one normal stack of its own (stopped after):
    the results of each, by rid.

    The stack ends each one idle (checked). ``stack_options`` go to ``start_normal_stack``.
    """
    runs = []
    with tempfile.TemporaryDirectory() as tmp, Launcher(tmp) as up:
        mem, _, sched = up.start_normal_stack(checkpoint, pool, **stack_options)
        for reqs in workloads:
            runs.append(run_all(sched.address, reqs))
            with MemClient(mem.address) as client:
                client.check(idle=True)
    return runs


def reference_run(checkpoint: Path, pool: list[str], reqs, **stack_options) -> dict:
    """``reqs`` through a normal stack of its own (stopped after): the results by rid."""
    return reference_runs(checkpoint, pool, reqs, **stack_options)[0]


@pytest.fixture(scope="module")
def big_stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose pool is large enough that nothing is retracted: the module's reference."""
    with Launcher(tmp_path_factory.mktemp("big")) as up:
        yield start_stack(up, checkpoint, BIG_POOL, name="-ref")
    assert not up.leaked_segments


@pytest.fixture(scope="module")
def small_stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack on the 256-token pool, for the tests that only send it bad requests and a
    few small ones (each ends with it idle)."""
    with Launcher(tmp_path_factory.mktemp("small")) as up:
        yield start_stack(up, checkpoint, SMALL_POOL)
    assert not up.leaked_segments


@pytest.fixture(scope="module")
def article(big_stack: Stack) -> dict:
    """The article's scenario (one request of ~0.85 of a 256-token pool plus shorter
    ones) and its outputs on a pool large enough that nothing is retracted."""
    reqs = workload(seed=1, count=6, long_len=200)
    results = run_all(big_stack.scheduler.address, reqs)
    assert_idle(big_stack)
    return {"reqs": reqs, "results": results}


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_article_scenario_retract_is_transparent(launcher, checkpoint, article, overlap) -> None:
    """With the overlap schedule on (the default) and off (``--disable-overlap-schedule``)."""
    reqs, want = article["reqs"], article["results"]
    off = ["--disable-overlap-schedule"] if overlap == "off" else []
    # A low conservativeness admits on optimistic output estimates: memory runs out mid-decode.
    pressure = start_stack(
        launcher,
        checkpoint,
        SMALL_POOL,
        name=f"-small-{overlap}",
        scheduler=["--schedule-conservativeness", "0.3", *off],
    )
    got = run_all(pressure.scheduler.address, reqs)
    assert finish_ids(got) == finish_ids(want)
    assert [r.finish_reason for r in got.values()] == [r.finish_reason for r in want.values()]
    retractions = sum(r.meta_info["num_retractions"] for r in got.values())
    assert retractions > 0, "the small pool should have forced retracts"
    assert sum(r.meta_info["num_retractions"] for r in want.values()) == 0
    with GenerateClient(pressure.scheduler.address) as client:
        stats = client.info()["stats"]
    assert stats["retracted_reqs"] == retractions and stats["reprefilled_tokens"] > 0
    assert (stats["reserved_ahead_steps"] > 0) is (overlap == "on")
    assert_idle(pressure)


def test_offload_retract_with_async_copies_is_transparent(launcher, checkpoint, article) -> None:
    """Every victim offloaded, memsvc's copies asynchronous (the cuda default, here on
    the shm copy thread): freed pages wait for their copy, outputs are unchanged."""
    reqs, want = article["reqs"], article["results"]
    pressure = start_stack(
        launcher,
        checkpoint,
        [*SMALL_POOL, "--offload-copy", "async"],
        name="-async",
        scheduler=["--schedule-conservativeness", "0.3", "--retract-mode", "offload"],
    )
    got = run_all(pressure.scheduler.address, reqs)
    assert finish_ids(got) == finish_ids(want)
    with GenerateClient(pressure.scheduler.address) as client:
        stats = client.info()["stats"]
    assert stats["retracted_reqs"] > 0 and stats["reprefilled_tokens"] == 0
    assert stats["offloaded_tokens"] > 0 and stats["loaded_tokens"] == stats["offloaded_tokens"]
    assert_idle(pressure)


def test_churn_under_test_retract(launcher, checkpoint, big_stack) -> None:
    reqs = workload(seed=2, count=32)
    want = run_all(big_stack.scheduler.address, reqs)
    churn = start_stack(
        launcher,
        checkpoint,
        BIG_POOL,
        name="-churn",
        env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"},
    )
    got = run_all(churn.scheduler.address, reqs)
    assert finish_ids(got) == finish_ids(want)
    assert sum(r.meta_info["num_retractions"] for r in got.values()) > 0
    for rid, result in got.items():
        # cached_tokens counts first-attempt hits only: never more than the prompt
        assert result.meta_info["cached_tokens"] <= len(dict((r, p) for r, p, _ in reqs)[rid])
    assert_idle(churn)


def test_too_big_input_is_rejected_at_once(small_stack: Stack) -> None:
    stack = small_stack
    with GenerateClient(stack.scheduler.address, timeout_s=10) as client:
        with pytest.raises(GenerateError) as info:
            client.generate([1] * 300, sampling={"max_new_tokens": 4})
        assert info.value.status_code == 400
        assert "input_len=300" in str(info.value) and "capacity=256" in str(info.value)
        # and the scheduler keeps serving
        result = client.generate([1, 2, 3], sampling={"max_new_tokens": 3, "ignore_eos": True})
        assert len(result.output_ids) == 3
    assert_idle(stack)


def test_the_scheduler_applies_the_gc_policy_once_started(small_stack: Stack) -> None:
    """Issue 28, item 4: the scheduler freezes what lives after start-up (see memsvc.gcpolicy)."""
    with GenerateClient(small_stack.scheduler.address, timeout_s=10) as client:
        state = client.info()["gc"]
    assert state["frozen"] > 10_000 and state["thresholds"] == list(THRESHOLDS)


def test_bad_input_gets_a_clear_error(small_stack: Stack) -> None:
    stack = small_stack
    ctx = zmq.Context()
    sock = rpc.dealer(ctx, stack.scheduler.address)
    try:
        gen = {"op": "generate", "rid": "a", "client": "c"}
        one = {"input_ids": np.array([1])}
        cases = [
            ([b"\xc1"], "malformed"),
            (wire.pack({**gen, "op_id": 1, "input_ids": [1, 2]}), "bad_request"),  # a list
            (
                wire.pack({**gen, "op_id": 2, "sampling": {"max_new_tokens": -1}}, one),
                "bad_request",
            ),
            (
                wire.pack({**gen, "op_id": 3, "sampling": {"temperature": "hot"}}, one),
                "bad_request",
            ),
            (wire.pack({**gen, "op_id": 4, "evil": 1}, one), "bad_request"),
            (wire.pack({**gen, "op_id": 5}, {"input_ids": np.array([1, 99999])}), "bad_request"),
            (
                wire.pack({"op": "generate", "op_id": 7, "rid": "a"}, one),
                "bad_request",
            ),  # no client
            (wire.pack({"op": "launch", "op_id": 6}), "unknown_op"),
        ]
        for frames, code in cases:
            sock.send_multipart(frames)
            assert sock.poll(10_000), "no reply"
            reply = wire.unpack(sock.recv_multipart())
            assert reply["ok"] is False and reply["code"] == code, reply
            assert reply["status_code"] == 400 and reply["message"]
    finally:
        sock.close(0)
        ctx.term()
    with GenerateClient(stack.scheduler.address, timeout_s=10) as client:
        nothing = client.generate([1, 2], sampling={"max_new_tokens": 0})
        assert nothing.output_ids == [] and nothing.finish_reason == {"type": "length", "length": 0}
        text = client.generate(text="hi", sampling={"max_new_tokens": 2, "ignore_eos": True})
        assert text.meta_info["prompt_tokens"] == 3  # bos + 2 bytes
        assert len(text.output_ids) == 2
    assert_idle(stack)


def test_priority_policy_needs_priority_scheduling(memsvc_factory) -> None:
    svc = memsvc_factory()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc",
            "--memsvc",
            svc.address,
            "--worker",
            "ipc:///nonexistent",
            "--retraction-policy",
            "priority",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert out.returncode == 2
    assert "retraction_policy='priority' requires enable_priority_scheduling" in out.stderr


def test_metrics_after_retracts(launcher, checkpoint) -> None:
    stack = start_stack(
        launcher,
        checkpoint,
        BIG_POOL,
        name="-m",
        scheduler=["--metrics-port", "0"],
        env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "2"},
    )
    got = run_all(stack.scheduler.address, workload(seed=3, count=4))
    retracted = sum(r.meta_info["num_retractions"] for r in got.values())
    port = stack.scheduler.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f"kvstack_retracted_reqs_total {float(retracted)}" in text
    for name in (
        "kvstack_num_retracted_reqs",
        "kvstack_new_token_ratio",
        "kvstack_num_running_reqs",
        "kvstack_num_queue_reqs",
        'kvstack_kv_tokens{state="used"}',
        "kvstack_token_usage",
    ):
        assert name in text, name
    assert_idle(stack)


MEDIUM_POOL = [*PAGE, "--num-pages", "128", "--max-running-requests", "32"]  # 512 tokens


def test_last_request_abort_and_abort_of_a_retracted_request(launcher, checkpoint):
    """Another memsvc session takes every free page while two requests decode: the one
    with the longer prompt is retracted, the last one still cannot grow and is aborted
    with the 500 message; the retracted one, aborted by its client while it waits,
    returns its partial output; the scheduler then keeps serving."""
    stack = start_stack(launcher, checkpoint, MEDIUM_POOL)

    async def scenario() -> None:
        async with AsyncGenerateClient(stack.scheduler.address, timeout_s=60) as client:
            last = asyncio.create_task(
                client.generate([3] * 8, rid="last", sampling={"max_new_tokens": 200})
            )
            victim = asyncio.create_task(
                client.generate([4] * 40, rid="victim", sampling={"max_new_tokens": 100})
            )
            for _ in range(500):
                if (await client.info())["num_running"] == 2:
                    break
                await asyncio.sleep(0.005)
            with MemClient(stack.memsvc.address) as hog:
                hog.alloc_row("hog")
                while not hog.alloc_extend([("hog", hog.stats()["available"])]).fits:
                    pass
                done_last = await last
                assert done_last.finish_reason == {
                    "type": "abort",
                    "message": RETRACT_ABORT_MESSAGE,
                    "status_code": 500,
                }
                assert 0 < len(done_last.output_ids) < 200
                info = await client.info()
                assert info["num_waiting"] == 1 and info["stats"]["retracted_reqs"] >= 1
                assert await client.abort("victim")
                done_victim = await victim
                assert done_victim.finish_reason["type"] == "abort"
                assert 0 < len(done_victim.output_ids) < 100  # what it had generated
                assert done_victim.meta_info["num_retractions"] >= 1
            # the hog said goodbye: its pages are back, and the scheduler keeps serving
            after = await client.generate(
                [5, 6, 7], sampling={"max_new_tokens": 5, "ignore_eos": True}
            )
            assert len(after.output_ids) == 5

    asyncio.run(scenario())
    assert_idle(stack)
