"""``kvstack up`` with a real model, fronted by ``kvstack serve --scheduler`` (issue 35).

The stack's scheduler tokenizes text with the model's tokenizer (SmolLM2's
"Hello" is one token, not bos + 5 bytes), and a front given only the
scheduler's address asks it which model it serves, so that it decodes and
renders chats with that model's tokenizer.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from scheduler_svc.client import GenerateClient, GenerateError
from tests.http.test_http_front import start_front, stop_front
from tests.procs import wait_for
from tests.supervisor.test_supervisor import run_dir, up

__all__ = ["run_dir", "up"]  # the fixtures, shared with test_supervisor

pytestmark = pytest.mark.timeout(600)

SERVED = "smol"


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as response:
        return response.status, await response.json()


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    return asyncio.run(_post(url, body))


def test_a_fronted_up_stack_speaks_the_models_tokens(
    up, run_dir: Path, tmp_path: Path, smollm2_checkpoint: Path, hf_tokenizer
) -> None:
    stack = up(
        "--model-path",
        str(smollm2_checkpoint),
        "--max-total-tokens",
        "1024",
        "--page-size",
        "16",
        "--served-model-name",
        SERVED,
        "--ready-timeout",
        "300",
    )
    state = wait_for(stack.healthy, 400, f"a healthy SmolLM2 stack:\n{stack.output()}")
    scheduler = next(p["address"] for p in state["processes"] if p["name"] == "scheduler_svc")
    front = start_front(tmp_path, "front", "--scheduler", scheduler, timeout=120)
    try:
        status, hello = post(
            f"{front.url}/generate",
            {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
        )
        assert status == 200, hello
        assert hf_tokenizer("Hello", add_special_tokens=False)["input_ids"] == [19556]
        assert hello["meta_info"]["prompt_tokens"] == 1, hello

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        status, chat = post(
            f"{front.url}/v1/chat/completions",
            {"messages": messages, "max_tokens": 8, "ignore_eos": True},
        )
        assert status == 200, chat
        rendered = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        want_prompt = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert chat["usage"]["prompt_tokens"] == len(want_prompt)
        assert chat["model"] and chat["choices"][0]["message"]["content"].isprintable(), chat

        async def model_info() -> dict[str, Any]:
            url = f"{front.url}/get_model_info"
            async with aiohttp.ClientSession() as http, http.get(url) as response:
                return await response.json()

        info = asyncio.run(model_info())
        assert info["model_path"] == str(smollm2_checkpoint.resolve())
        assert info["served_model_name"] == SERVED

        # SmolLM2 adds no bos: the empty text is no token at all, refused at intake
        with (
            GenerateClient(scheduler, timeout_s=60) as client,
            pytest.raises(GenerateError, match="Prompt cannot be empty") as refused,
        ):
            client.generate(text="", sampling={"max_new_tokens": 2})
        assert refused.value.status_code == 400
    finally:
        assert stop_front(front, signal.SIGTERM) == 0, front.log()
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(120) == 0, stack.output()
