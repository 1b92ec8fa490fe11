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

import numpy as np
import pytest
import zmq

from memsvc import protocol as wire
from memsvc import rpc
from scheduler_svc.client import (
    AsyncGenerateClient,
    GenerateClient,
    GenerateError,
    SchedulerLostError,
)
from scheduler_svc.protocol import MAX_PROMPT_TOKENS
from tests.procs import start_stack
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


def test_float32_edge_sampling_fails_alone(launcher, checkpoint) -> None:
    stack = start_stack(launcher, checkpoint, SMALL_POOL)
    address = stack.scheduler.address
    want = _generate_all(address, {"greedy": INNOCENT})["greedy"].output_ids
    ctx = zmq.Context()
    raw = rpc.dealer(ctx, address)  # the client itself refuses a top_p it cannot send
    try:
        sampling = {**INNOCENT, "temperature": 1.0, "top_p": 1e-46}
        header = {"op": "generate", "op_id": 7, "rid": "tiny-top-p", "sampling": sampling}
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


def test_a_validation_error_reaches_the_client_at_once(launcher, checkpoint) -> None:
    stack = start_stack(launcher, checkpoint, SMALL_POOL)
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
