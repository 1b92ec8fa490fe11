"""Bad requests fail alone and at once (issue 18, defects 3 and 4): a normal stack, real processes.

- Sampling values that float32 cannot use must never reach the model as NaN or
  an empty distribution: a temperature below SGLang's ``_SAMPLING_EPS`` is
  greedy (SGLang's rule), a ``top_p`` that is 0 in float32 is refused with 400,
  and a request decoding beside them is untouched.
- A validation error is answered under the op_id of the message it is about,
  so the client raises it at once instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvstack.stack.launch import Launcher
from memsvc import protocol as wire
from memsvc import rpc
from scheduler_svc.client import (
    AsyncGenerateClient,
    GenerateClient,
    GenerateError,
    SchedulerLostError,
)
from scheduler_svc.protocol import MAX_PROMPT_TOKENS
from tests.bounds import assert_messages_bounded
from tests.procs import Stack, start_stack
from tests.scheduler_service.test_normal_mode import SMALL_POOL, assert_idle

PROMPT = list(range(3, 20))
INNOCENT = {"max_new_tokens": 40, "ignore_eos": True}


def _generate_all(address: str, jobs: dict[str, dict]) -> dict[str, object]:
    """Every job at once (so they share batches); each one's result or error."""

    async def one(client: AsyncGenerateClient, sampling: dict) -> object:
        try:
            return await client.generate(PROMPT, sampling=sampling)
        except GenerateError as exc:
            return exc

    async def go() -> dict[str, object]:
        async with AsyncGenerateClient(address, timeout_s=60, resubmits=0) as client:
            results = await asyncio.gather(*(one(client, s) for s in jobs.values()))
        return dict(zip(jobs, results, strict=True))

    return asyncio.run(go())


@pytest.fixture(scope="module")
def stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the tests below that send it bad requests and check that it goes
    on serving and ends idle (the bounded-socket test, which measures the scheduler's
    peak memory, starts its own)."""
    with Launcher(tmp_path_factory.mktemp("stack")) as up:
        yield start_stack(up, checkpoint, SMALL_POOL)
    assert not up.leaked_segments


def test_float32_edge_sampling_fails_alone(stack: Stack) -> None:
    address = stack.scheduler.address
    want = _generate_all(address, {"greedy": INNOCENT})["greedy"].output_ids
    ctx = zmq.Context()
    raw = rpc.dealer(ctx, address)  # the client itself refuses a top_p it cannot send
    try:
        sampling = {**INNOCENT, "temperature": 1.0, "top_p": 1e-46}
        header = {"op": "generate", "op_id": 7, "rid": "tiny-top-p", "client": "raw"}
        header["sampling"] = sampling
        raw.send_multipart(wire.pack(header, {"input_ids": np.array(PROMPT)}))
        got = _generate_all(
            address,
            {
                "innocent": INNOCENT,
                "tiny_temperature": {**INNOCENT, "temperature": 1e-300},
                "innocent_sampled": {**INNOCENT, "temperature": 0.7, "top_p": 0.9, "seed": 5},
            },
        )
        assert raw.poll(10_000), "no reply"
        refused = wire.unpack(raw.recv_multipart())
    finally:
        raw.close(0)
        ctx.term()
    assert got["innocent"].output_ids == want, got["innocent"]
    # SGLang: 0 <= temperature < _SAMPLING_EPS is greedy
    assert got["tiny_temperature"].output_ids == want, got["tiny_temperature"]
    assert len(got["innocent_sampled"].output_ids) == INNOCENT["max_new_tokens"]
    assert (refused["ok"], refused["op_id"], refused["status_code"]) == (False, 7, 400), refused
    assert refused["code"] == "bad_request" and "float32" in refused["message"]
    assert_idle(stack)


def test_a_validation_error_reaches_the_client_at_once(stack: Stack) -> None:
    address = stack.scheduler.address
    with GenerateClient(address, timeout_s=3, resubmits=1) as client:
        started = time.monotonic()
        with pytest.raises(GenerateError) as empty:
            client.generate(input_ids=[])
        assert time.monotonic() - started < 2.5
        assert not isinstance(empty.value, SchedulerLostError)
        assert empty.value.status_code == 400 and "1 or more tokens" in str(empty.value)
        with pytest.raises(GenerateError) as huge:
            client.generate(input_ids=np.ones(MAX_PROMPT_TOKENS + 1, dtype=np.int64))
        assert not isinstance(huge.value, SchedulerLostError)
        message = str(huge.value)
        assert "1 or more" not in message and str(MAX_PROMPT_TOKENS) in message, message
        assert len(client.generate(PROMPT, sampling={"max_new_tokens": 2}).output_ids) == 2
    _assert_raw_errors_echo_the_op_id(address)
    assert_idle(stack)


def _assert_raw_errors_echo_the_op_id(address: str) -> None:
    """Even when the rest of the message is invalid, a readable op_id comes back."""
    ctx = zmq.Context()
    sock = rpc.dealer(ctx, address)
    try:
        cases = [
            (wire.pack({"op": "generate", "op_id": 41, "rid": "a", "input_ids": [1]}), 41),
            (wire.pack({"op": "launch", "op_id": 42}), 42),
            (wire.pack({"op": "info", "op_id": 43, "evil": 1}), 43),
            (wire.pack({"op": "generate", "op_id": -5, "rid": "a"}), -5),
            ([b"\xc1"], None),
        ]
        for frames, op_id in cases:
            sock.send_multipart(frames)
            assert sock.poll(10_000), "no reply"
            reply = wire.unpack(sock.recv_multipart())
            assert reply["ok"] is False and reply["op_id"] == op_id, reply
            assert reply["status_code"] == 400
    finally:
        sock.close(0)
        ctx.term()


def test_a_message_is_bounded_on_the_scheduler_socket(launcher, checkpoint) -> None:
    """Issue 18, defect 5: the scheduler's socket had no limit at all (one 300 MiB frame
    took its RSS from 57 to 680 MB). No generate needs 16 MiB or 16 frames; a frame
    past 64 MiB drops the sender unread."""
    stack = start_stack(launcher, checkpoint, SMALL_POOL)
    assert_messages_bounded(
        stack.scheduler.address,
        {"op": "generate", "rid": "big"},
        over_bytes=[9 << 20, 9 << 20],
        pid=stack.scheduler.proc.pid,
        frame_over_cap=(64 << 20) + 1,
    )
    with GenerateClient(stack.scheduler.address, timeout_s=30) as client:
        assert len(client.generate(PROMPT, sampling={"max_new_tokens": 2}).output_ids) == 2
    assert_idle(stack)


def test_a_rid_belongs_to_the_client_that_submitted_it(stack: Stack) -> None:
    """Issue 18, defect 6: re-submitting a live rid with the same body took over its
    replies (the owner waited out its timeout), and any client could abort any rid.
    The owner's own re-submission, from a new socket, still gets its result."""
    address = stack.scheduler.address
    sampling = {"max_new_tokens": 200, "ignore_eos": True}

    def intrude() -> tuple[object, object]:
        outcomes = []
        with GenerateClient(address, timeout_s=3, resubmits=0) as other:
            for attempt in (
                lambda: other.generate(PROMPT, sampling=sampling, rid="r"),
                lambda: other.abort("r"),
            ):
                try:
                    outcomes.append(attempt())
                except GenerateError as exc:
                    outcomes.append(exc)
        return outcomes[0], outcomes[1]

    async def go() -> tuple[list, object, object, str]:
        async with AsyncGenerateClient(address, timeout_s=20, resubmits=0) as owner:
            stream = owner.stream(PROMPT, sampling=sampling, rid="r")
            items = [await anext(stream)]  # a first chunk: "r" is live
            taken, refused = await asyncio.to_thread(intrude)
            items += [item async for item in stream]
        return items, taken, refused, owner.client_id

    items, taken, refused, owner_id = asyncio.run(go())
    assert isinstance(taken, GenerateError) and not isinstance(taken, SchedulerLostError), taken
    assert taken.code == "duplicate_rid", taken
    assert isinstance(refused, GenerateError) and refused.code == "not_owner", refused
    result = items[-1]
    assert result.finish_reason["type"] == "length", result.finish_reason
    assert len(result.output_ids) == sampling["max_new_tokens"]
    with GenerateClient(address, timeout_s=10, resubmits=0, client_id=owner_id) as again:
        assert again.generate(PROMPT, sampling=sampling, rid="r").output_ids == result.output_ids
    assert_idle(stack)
