"""SGLang's generate features at the scheduler, end to end on the tiny model (one stack).

Logprobs (return_logprob, logprob_start_len, top_logprobs_num) against the dense
reference, streamed meta_info, stop strings (trimmed or not), min_new_tokens,
SGLang's intake validation, and flush_cache.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from model_svc.model import LlamaModel
from model_svc.reference import dense_logits
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateClient, GenerateError
from tests.procs import Stack, start_stack

CONTEXT = 256
POOL = ["--page-size", "4", "--num-pages", "256", "--dtype", "float32"]
POOL += ["--max-context-len", str(CONTEXT)]
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 5, 6, 7]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Stack]:
    with Launcher(tmp_path_factory.mktemp("sglang-generate")) as launcher:
        yield start_stack(launcher, checkpoint, POOL)
    assert not launcher.leaked_segments


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[GenerateClient]:
    with GenerateClient(stack.scheduler.address, timeout_s=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> LlamaModel:
    return LlamaModel.from_checkpoint(checkpoint)


def idle(stack: Stack) -> None:
    with MemClient(stack.memsvc.address) as mem:
        mem.check(idle=True)


def greedy(client: GenerateClient, n: int = 24, **sampling):
    return client.generate(PROMPT, sampling={"max_new_tokens": n, "ignore_eos": True, **sampling})


# -- logprobs --------------------------------------------------------------------------


def test_logprobs_are_the_reference_models_in_sglang_shape(stack, client, reference) -> None:
    plain = greedy(client)
    start = 4
    got = client.generate(
        PROMPT,
        sampling={"max_new_tokens": 24, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
    )
    assert got.output_ids == plain.output_ids  # greedy tokens do not change
    assert "output_token_logprobs" not in plain.meta_info
    meta = got.meta_info
    seq = PROMPT + got.output_ids
    want = torch.log_softmax(dense_logits(reference, seq), -1)
    # Output token i sits at position len(PROMPT) + i, scored by the logits before it.
    out = meta["output_token_logprobs"]
    assert [t for _, t, _ in out] == got.output_ids and all(x is None for *_, x in out)
    expected = [float(want[len(PROMPT) + i - 1, t]) for i, t in enumerate(got.output_ids)]
    np.testing.assert_allclose([v for v, _, _ in out], expected, rtol=1e-4, atol=1e-4)
    # The prompt from logprob_start_len: its first entry has no logprob (SGLang's shape).
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == PROMPT[start:]
    assert inp[0][0] is None
    expected = [float(want[p - 1, PROMPT[p]]) for p in range(start + 1, len(PROMPT))]
    np.testing.assert_allclose([v for v, _, _ in inp[1:]], expected, rtol=1e-4, atol=1e-4)
    # Top-3: per position, most likely first; None where SGLang has none.
    assert meta["input_top_logprobs"][0] is None
    assert len(meta["input_top_logprobs"]) == len(inp)
    for i, top in enumerate(meta["output_top_logprobs"]):
        best = want[len(PROMPT) + i - 1].topk(3)
        assert [t for _, t, _ in top] == best.indices.tolist()
        assert top[0][1] == got.output_ids[i]  # greedy: the chosen one is the best
    idle(stack)


def test_logprob_defaults_and_bounds(stack, client) -> None:
    got = client.generate(PROMPT, sampling={"max_new_tokens": 3}, return_logprob=True)
    meta = got.meta_info
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output only
    assert len(meta["output_token_logprobs"]) == len(got.output_ids)
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    with pytest.raises(GenerateError, match="logprob_start_len=18 is higher than") as err:
        client.generate(PROMPT, return_logprob=True, logprob_start_len=len(PROMPT) + 1)
    assert err.value.status_code == 400
    with pytest.raises(GenerateError, match="top_logprobs_num"):
        client.generate(PROMPT, return_logprob=True, top_logprobs_num=21)
    # max_new_tokens 0 scores the prompt: its logprobs, no output.
    scored = client.generate(
        PROMPT, sampling={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert scored.output_ids == [] and scored.meta_info["output_token_logprobs"] == []
    assert len(scored.meta_info["input_token_logprobs"]) == len(PROMPT)
    assert scored.meta_info["finish_reason"] == {"type": "length", "length": 0}
    idle(stack)


def test_stream_chunks_carry_meta_info_and_their_tokens_logprobs(stack) -> None:
    async def go():
        async with AsyncGenerateClient(stack.scheduler.address, timeout_s=120) as client:
            return [
                item
                async for item in client.stream(
                    PROMPT,
                    sampling={"max_new_tokens": 12, "ignore_eos": True},
                    return_logprob=True,
                    logprob_start_len=0,
                )
            ]

    items = asyncio.run(go())
    chunks, done = items[:-1], items[-1]
    assert chunks and all(isinstance(c, Chunk) for c in chunks)
    streamed: list = []
    for chunk in chunks:
        meta = chunk.meta_info
        assert meta["prompt_tokens"] == len(PROMPT)
        assert meta["completion_tokens"] == chunk.offset + len(chunk.token_ids)
        assert meta["num_retractions"] == 0 and "cached_tokens" in meta
        assert "finish_reason" not in meta
        assert [t for _, t, _ in meta["output_token_logprobs"]] == chunk.token_ids
        assert ("input_token_logprobs" in meta) == (chunk.offset == 0)
        streamed += meta["output_token_logprobs"]
    assert chunks[0].meta_info["input_token_logprobs"] == done.meta_info["input_token_logprobs"]
    full = done.meta_info["output_token_logprobs"]
    assert streamed == full[: len(streamed)] and len(full) == 12
    idle(stack)


# -- stop strings, min_new_tokens ------------------------------------------------------


def test_a_stop_string_ends_the_request_and_is_trimmed(stack, client) -> None:
    plain = greedy(client, 40)
    text = plain.text
    stop = next(text[i : i + 2] for i in range(6, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    at = text.find(stop)
    got = greedy(client, 40, stop=["never-there", stop])
    assert got.meta_info["finish_reason"] == {"type": "stop", "matched": stop}
    assert got.text == text[:at]
    assert got.output_ids == plain.output_ids[: len(got.output_ids)]
    assert stop in client_decode(got.output_ids) and stop not in client_decode(got.output_ids[:-1])
    kept = greedy(client, 40, stop=[stop], no_stop_trim=True)
    assert kept.output_ids == got.output_ids and kept.text.endswith(stop)
    idle(stack)


def client_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_min_new_tokens_masks_stop_ids_before_it(stack, client) -> None:
    plain = greedy(client, 30)
    stop_id = plain.output_ids[2]
    eos = {"ignore_eos": False}  # stop ids, like EOS, are ignored under ignore_eos
    early = greedy(client, 30, stop_token_ids=[stop_id], **eos)
    assert early.meta_info["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert early.output_ids == plain.output_ids[:3]
    assert early.text == client_decode(plain.output_ids[:2])  # the stop token's text is cut
    late = greedy(client, 30, stop_token_ids=[stop_id], min_new_tokens=6, **eos)
    assert stop_id not in late.output_ids[:6]
    assert late.output_ids[:2] == plain.output_ids[:2] and late.output_ids[2] != stop_id
    reason = late.meta_info["finish_reason"]
    assert reason == {"type": "length", "length": 30} or (
        reason == {"type": "stop", "matched": stop_id} and late.output_ids[-1] == stop_id
    )
    idle(stack)


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "max_new", "message"),
    [
        ([1, 2, 300], 4, r"Token ID 300 is out of vocabulary \(vocab size: 259\)"),
        ([1] * CONTEXT, 1, r"The input \(256 tokens\) is longer than the model's context length"),
        (
            [1] * 200,
            57,
            r"You requested a total of 257 tokens: 200 tokens from the input messages and 57",
        ),
    ],
)
def test_sglang_intake_validation(stack, client, ids, max_new, message) -> None:
    with pytest.raises(GenerateError, match=message) as err:
        client.generate(ids, sampling={"max_new_tokens": max_new})
    assert err.value.status_code == 400
    idle(stack)


def test_prompt_plus_max_new_tokens_up_to_the_context_runs_whole(stack, client) -> None:
    got = client.generate([1] * 200, sampling={"max_new_tokens": 56, "ignore_eos": True})
    assert len(got.output_ids) == 56
    idle(stack)


# -- flush_cache -----------------------------------------------------------------------


def test_flush_cache_empties_the_tree_only_when_idle(stack, client) -> None:
    greedy(client, 4)
    with MemClient(stack.memsvc.address) as mem:
        mem.heartbeat()
        assert mem.sizes.evictable > 0
    started = threading.Event()

    def long_request() -> None:
        with GenerateClient(stack.scheduler.address, timeout_s=120) as other:
            for _ in other.stream(PROMPT, sampling={"max_new_tokens": 200, "ignore_eos": True}):
                started.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        assert started.wait(60)
        flushed, message = client.flush_cache()
        assert not flushed
        assert message.startswith("Cache not flushed because there are pending requests.")
    finally:
        worker.join(120)
    flushed, message = client.flush_cache()
    assert flushed, message
    with MemClient(stack.memsvc.address) as mem:
        mem.heartbeat()
        assert mem.sizes.evictable == 0
        mem.check(idle=True)
    # The cache fills again: a repeat of a request is a hit once more.
    greedy(client, 4)
    assert greedy(client, 4).meta_info["cached_tokens"] > 0
    idle(stack)
