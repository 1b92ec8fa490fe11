"""SmolLM2 through whole stacks: under retract pressure, and behind kvstack serve (16: 7b, 7c).

(b) The 9 prompts of ``tests/smollm2.py``, up to 48 greedy tokens each, all
submitted at once to a stack whose pool is far too small for them: 256 tokens
for about 700 of demand, the ``long`` prompt taking 150 (as in the article,
the demo and tests/scheduler_service), and eos not ignored, so that admission
reserves only an estimate of each running request's output and decoding
outgrows the pool. In normal mode with each retract mode that changes what a
victim's KV becomes (recompute: freed and re-prefilled; offload: copied to
memsvc's host store and back) and in PD mode (the decode node offloads its
victims). Every output must be transformers' own greedy continuation, token
for token, and each stack must really have retracted, and end idle. In normal
mode the requests also ask for logprobs (return_logprob, top 2): each output
token's must be transformers' log_softmax of that step's scores.

(c) ``kvstack serve --model-path smollm2`` (resolved in the session's kvstack
home) answers a chat prompt, rendered with the checkpoint's template, on
``/generate``: the answer names Paris and ends the turn at ``<|im_end|>``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from model_svc.config import ModelConfig
from model_svc.tokenizer import load_tokenizer
from scheduler_svc.client import AsyncGenerateClient, GenerateClient
from tests.http.test_http_front import start_front, stop_front
from tests.smollm2 import CHATS, NUM_NEW, mismatch

POOL = ["--page-size", "4", "--max-running-requests", "16", "--max-context-len", "512"]
PRESSURE = ["--schedule-conservativeness", "0.3"]
SMALL = ["--num-pages", "64"]  # 256 tokens
# Not ignore_eos: SGLang reserves a running request's whole remaining output when it
# ignores eos, so nothing would be over-admitted and nothing retracted.
GREEDY = {"max_new_tokens": NUM_NEW}


def run_all(address: str, prompts: dict[str, list[int]], **logprobs) -> dict:
    """Every prompt at once; the results by rid. ``logprobs``: SGLang's logprob arguments."""

    async def go() -> dict:
        async with AsyncGenerateClient(address, timeout_s=300) as client:
            results = await asyncio.gather(
                *(
                    client.generate(ids, rid=rid, sampling=GREEDY, **logprobs)
                    for rid, ids in prompts.items()
                )
            )
        return {r.rid: r for r in results}

    return asyncio.run(go())


def check_logprobs_against_transformers(results: dict, hf_greedy: dict) -> None:
    """Each output token's logprob is transformers' log_softmax of its greedy step's scores
    (one per token, none lost or repeated by the retracts), with the top-2 alike."""
    for rid, r in results.items():
        logprobs = r.meta_info["output_token_logprobs"]
        assert [token for _, token, _ in logprobs] == r.output_ids, rid
        want = torch.log_softmax(hf_greedy[rid]["scores"][: len(r.output_ids)], dim=-1)
        expected = want.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        got = torch.tensor([value for value, _, _ in logprobs])
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3, msg=rid)
        tops = r.meta_info["output_top_logprobs"]
        assert [top[0][1] for top in tops] == r.output_ids, rid  # greedy: the best one
        assert all(len(top) == 2 for top in tops)


def check_against_transformers(results: dict, hf_greedy: dict, hf_tokenizer) -> int:
    """Fails unless every output is transformers' (up to and with the eos that ended it,
    where one did); returns the retractions it took."""
    problems = [
        mismatch(rid, list(r.output_ids), hf_greedy[rid], hf_tokenizer)
        for rid, r in results.items()
    ]
    assert not any(problems), "\n".join(filter(None, problems))
    for rid, r in results.items():
        ended = r.output_ids[-1] == hf_tokenizer.eos_token_id
        assert len(r.output_ids) == NUM_NEW or ended, (rid, r.meta_info)
    return sum(r.meta_info["num_retractions"] for r in results.values())


def assert_idle(*addresses: str) -> None:
    for address in addresses:
        with MemClient(address) as mem:
            mem.check(idle=True)
            assert mem.stats()["host_store_entries"] == 0


@pytest.mark.parametrize("retract_mode", ["recompute", "offload"])
def test_normal_mode_under_retract_pressure_equals_transformers(
    tmp_path: Path, smollm2_checkpoint: Path, prompts, hf_greedy, hf_tokenizer, retract_mode: str
) -> None:
    with Launcher(tmp_path) as launcher:
        mem, _, sched = launcher.start_normal_stack(
            smollm2_checkpoint,
            [*POOL, *SMALL],
            [*PRESSURE, "--retract-mode", retract_mode],
        )
        # With logprobs asked for (their bookkeeping must survive the retracts): the
        # greedy tokens are the same, and their logprobs are transformers'.
        results = run_all(sched.address, prompts, return_logprob=True, top_logprobs_num=2)
        retractions = check_against_transformers(results, hf_greedy, hf_tokenizer)
        check_logprobs_against_transformers(results, hf_greedy)
        with GenerateClient(sched.address) as client:
            stats = client.info()["stats"]
        assert retractions > 0 and stats["retracted_reqs"] == retractions
        if retract_mode == "recompute":
            assert stats["reprefilled_tokens"] > 0 and stats["offloaded_tokens"] == 0
        else:
            assert stats["reprefilled_tokens"] == 0
            assert stats["offloaded_tokens"] == stats["loaded_tokens"] > 0
        assert_idle(mem.address)
    assert launcher.leaked_segments == []


def test_pd_mode_under_retract_pressure_equals_transformers(
    tmp_path: Path, smollm2_checkpoint: Path, prompts, hf_greedy, hf_tokenizer
) -> None:
    with Launcher(tmp_path) as launcher:
        up = launcher.start_pd_stack(
            smollm2_checkpoint,
            [*POOL, "--num-pages", "256"],
            ["--num-reserved-decode-tokens", "8"],
            decode_pool=SMALL,
            decode_scheduler=PRESSURE,
        )
        results = run_all(up["router"].address, prompts)
        retractions = check_against_transformers(results, hf_greedy, hf_tokenizer)
        with GenerateClient(up["scheduler-d"].address) as client:
            stats = client.info()["stats"]
        assert retractions > 0 and stats["retract_events"] > 0
        assert stats["offloaded_tokens"] == stats["loaded_tokens"] > 0
        assert_idle(up["memsvc-p"].address, up["memsvc-d"].address)
    assert launcher.leaked_segments == []


def test_serve_model_path_smollm2_answers_a_chat_prompt(
    tmp_path: Path,
    monkeypatch,
    smollm2_home: Path,
    smollm2_checkpoint: Path,
    hf_greedy,
    hf_tokenizer,
) -> None:
    monkeypatch.setenv("KVSTACK_HOME", str(smollm2_home))  # the name resolves there
    tokenizer = load_tokenizer(smollm2_checkpoint, ModelConfig.from_file(smollm2_checkpoint))
    text = tokenizer.chat_template.render([{"role": "user", "content": CHATS[0]}])
    front = start_front(tmp_path, "smollm2", "--model-path", "smollm2", timeout=300)
    try:

        async def ask() -> dict:
            async with aiohttp.ClientSession() as session:
                body = {"text": text, "sampling_params": {"max_new_tokens": NUM_NEW}}
                async with session.post(f"{front.url}/generate", json=body) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()

        answer = asyncio.run(ask())
    finally:
        assert stop_front(front) == 0, front.log()
    meta = answer["meta_info"]
    assert "Paris" in answer["text"], answer
    assert meta["finish_reason"]["type"] == "stop", meta  # <|im_end|> ended the turn
    # The scheduler encodes the text as transformers does by default (no bos for SmolLM2).
    assert meta["prompt_tokens"] == len(hf_tokenizer(text)["input_ids"])
    # The tokens up to and with <|im_end|> are transformers' greedy ones.
    want = hf_greedy["chat0"]["tokens"]
    end = want.index(tokenizer.eos_ids[0]) + 1
    assert answer["output_ids"] == want[:end]
