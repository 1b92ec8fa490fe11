"""The OpenAI-compatible API on the real SmolLM2 (issue 17): its chat template, its tokenizer.

One ``kvstack serve`` of SmolLM2-135M-Instruct serves the module, driven with
the official ``openai`` package. Chat prompts are rendered with the
checkpoint's own template, and the answers are judged against transformers'
greedy continuation of the same prompt (``oracle``): text, and the
logprobs of each token against transformers' scores.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.http.test_http_front import Front, start_front, stop_front
from tests.smollm2 import CHATS, TEXTS

# The first test's setup may be the session's SmolLM2 fetch (a GGUF converted to float32),
# the module's transformers oracle and a serve start: minutes on two busy cores.
pytestmark = pytest.mark.timeout(600)

CAPACITY = 2048
POOL = ["--max-total-tokens", str(CAPACITY), "--page-size", "16"]
N = 12  # tokens per answer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Path) -> Any:
    workdir = tmp_path_factory.mktemp("openai-smollm2")
    front = start_front(
        workdir, "smollm2", "--model-path", str(smollm2_checkpoint), *POOL, timeout=300
    )
    try:
        yield front
        # the pool is whole again: every page free or cached, none held by a request
        tokens = memsvc_tokens(front)
        assert tokens.get("used", 0) == 0, tokens
        assert tokens["available"] + tokens["evictable"] == CAPACITY, tokens
    finally:
        assert stop_front(front, signal.SIGTERM) == 0, front.log()


def memsvc_tokens(front: Front) -> dict[str, float]:
    async def scrape() -> str:
        async with aiohttp.ClientSession() as http, http.get(f"{front.url}/metrics") as response:
            return await response.text()

    return {
        s.labels["state"]: s.value
        for f in text_string_to_metric_families(asyncio.run(scrape()))
        if f.name == "memsvc_tokens"
        for s in f.samples
    }


@pytest.fixture(scope="module")
def oracle(smollm2_checkpoint: Path, prompts: dict[str, list[int]]) -> dict[str, dict]:
    """transformers' greedy N tokens (and scores) for chat0 and text0: the oracle, as
    ``tests.smollm2.hf_greedy`` but only what this module needs (hf_greedy's 9 prompts x 48
    tokens take minutes on two busy cores)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for rid in ("chat0", "text0"):
            ids = prompts[rid]
            generated = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=N,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
                return_dict_in_generate=True,
                output_scores=True,
            )
            out[rid] = {
                "tokens": generated.sequences[0, len(ids) :].tolist(),
                "scores": torch.cat(generated.scores).float(),
            }
    return out


def client(server: Front) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_completion_is_transformers_greedy_answer(
    server: Front, oracle, hf_tokenizer, prompts
) -> None:
    api = client(server)
    model = api.models.list().data[0].id
    got = api.chat.completions.create(
        model=model,
        messages=chat(CHATS[0]),
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    want = oracle["chat0"]
    (choice,) = got.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == hf_tokenizer.decode(
        want["tokens"][:N], skip_special_tokens=True
    )
    assert choice.finish_reason == "length"
    assert got.object == "chat.completion" and got.model == model
    assert got.usage.prompt_tokens == len(prompts["chat0"])  # the template rendered as HF's
    assert got.usage.completion_tokens == N
    content = choice.logprobs.content
    assert len(content) == N
    for step, (entry, token) in enumerate(zip(content, want["tokens"], strict=False)):
        logprobs = torch.log_softmax(want["scores"][step].double(), dim=-1)
        assert entry.token == hf_tokenizer.decode([token])
        assert entry.logprob == pytest.approx(float(logprobs[token]), abs=2e-3)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token


def test_chat_stream_with_usage_is_the_same_answer(server: Front, prompts) -> None:
    api = client(server)
    kwargs = {
        "model": "x",
        "messages": chat(CHATS[1]),
        "max_completion_tokens": N,
        "temperature": 0,
    }
    whole = api.chat.completions.create(**kwargs)
    chunks = list(
        api.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert (
        "".join(c.choices[0].delta.content or "" for c in deltas)
        == whole.choices[0].message.content
    )
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage.prompt_tokens == len(prompts["chat1"])
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    plain = list(api.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason is not None


def test_chat_ends_its_turn_and_stops_on_a_string(server: Front) -> None:
    api = client(server)
    free = api.chat.completions.create(model="x", messages=chat(CHATS[0]), temperature=0)
    assert free.choices[0].finish_reason == "stop"  # <|im_end|>, with no max_tokens given
    assert "Paris" in free.choices[0].message.content
    stopped = api.chat.completions.create(
        model="x", messages=chat(CHATS[0]), temperature=0, stop="Paris"
    )
    content = stopped.choices[0].message.content
    assert free.choices[0].message.content.startswith(content) and "Paris" not in content
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["matched_stop"] == "Paris"
    stream = api.chat.completions.create(
        model="x", messages=chat(CHATS[0]), temperature=0, stop=["Paris"], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == content


def test_text_completion_is_transformers_greedy_continuation(
    server: Front, oracle, hf_tokenizer, prompts
) -> None:
    got = client(server).completions.create(
        model="x", prompt=TEXTS[0], max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == hf_tokenizer.decode(oracle["text0"]["tokens"][:N])
    assert got.usage.prompt_tokens == len(prompts["text0"])


def test_context_overflow_is_a_400(server: Front) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model="x", prompt=[1] * 10, max_tokens=9000)
    assert "context length" in caught.value.body["message"]
    assert caught.value.body["object"] == "error"
