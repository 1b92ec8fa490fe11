"""SGLang's router (SMG 1.13.0) in front of two ``kvstack serve`` nodes of SmolLM2-135M-Instruct.

The tiny model's module (:mod:`tests.http.test_smg_normal`) covers the routes and a
node's death; this one adds what only a real checkpoint has: the chat template and
the tokenizer. Chat and text completions (streamed and not) and ``/generate``
through SMG answer exactly what one node answers alone.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.http.test_http_front import start_front, stop_front
from tests.http.test_smg_normal import output_of, post, run
from tests.smg import start_smg
from tests.smollm2 import CHATS, TEXTS

pytestmark = pytest.mark.timeout(600)

POOL = ["--max-total-tokens", "2048", "--page-size", "16"]
N = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Path) -> Any:
    workdir = tmp_path_factory.mktemp("smg-smollm2")
    args = ["--model-path", str(smollm2_checkpoint), "--served-model-name", "smollm2", *POOL]
    fronts = []
    router = None
    try:
        for name in ("a", "b"):
            fronts.append(start_front(workdir, name, *args, timeout=300))
        urls = [front.url for front in fronts]
        router = start_smg(
            workdir, "--worker-urls", *urls, "--policy", "cache_aware", num_workers=2
        )
        yield fronts, router
    finally:
        if router is not None:
            router.stop()
        for front in fronts:
            assert stop_front(front, signal.SIGTERM) == 0, front.log()


def test_chat_completion_and_generate_through_smg_answer_as_one_node(cluster) -> None:
    fronts, router = cluster
    requests: list[tuple[str, dict]] = []
    for chat in CHATS[:2]:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": chat}],
            "max_tokens": N,
            "temperature": 0.0,
        }
        requests += [
            ("/v1/chat/completions", body),
            ("/v1/chat/completions", {**body, "stream": True}),
        ]
    for text in TEXTS[:2]:
        body = {"model": "smollm2", "prompt": text, "max_tokens": N, "temperature": 0.0}
        requests += [("/v1/completions", body), ("/v1/completions", {**body, "stream": True})]
        sampling = {"max_new_tokens": N, "temperature": 0.0}
        requests += [("/generate", {"text": text, "sampling_params": sampling, "stream": True})]

    async def go() -> list[tuple[Any, Any, Any]]:
        async with aiohttp.ClientSession() as http:
            out = []
            for route, body in requests:
                alone = output_of(route, body, *await post(http, fronts[0].url + route, body))
                routed = output_of(route, body, *await post(http, router.url + route, body))
                out.append(((route, body.get("stream", False)), alone, routed))
            return out

    for where, alone, routed in run(go()):
        assert routed == alone, where
        assert alone[0], where  # some text or ids came out
