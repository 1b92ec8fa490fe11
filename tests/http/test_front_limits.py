"""What one request may cost ``kvstack serve``'s front (issue 26, items 6 and 7), in process.

- A body over the cap is refused with 413 before it is read, naming the cap.
- A large body under the cap is parsed and validated off the event loop:
  ``/health`` keeps answering while it is, and the check for NaN and infinities
  allocates nothing per element.
- A batch is capped in prompts and in scheduler requests (prompts × ``n``):
  400 naming the cap, before any request is sent.

The front points at an address where nothing listens; ``/health`` is made to
answer without a scheduler, so that what it measures is the event loop alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import tracemalloc
import urllib.request
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvstack.serve.app import Backend, HttpFront
from kvstack.serve.body import find_non_finite
from model_svc.tokenizer import ByteTokenizer

NOWHERE = "ipc:///nonexistent/kvstack-limits-test.sock"
DEFAULT_MAX_BODY_BYTES = 16 << 20  # --max-request-body-bytes, as README and --help say


def _front(**kwargs: Any) -> HttpFront:
    front = HttpFront(
        Backend(NOWHERE),
        mode="normal",
        tokenizer=ByteTokenizer(),
        request_timeout_s=2.0,
        control_timeout_s=1.0,
        **kwargs,
    )

    async def info() -> dict[str, Any]:  # /health without a scheduler: the loop alone
        return {}

    front.path.info = info  # type: ignore[method-assign]
    return front


def _ids_body(num_ids: int) -> bytes:
    return b'{"input_ids": [' + b", ".join([b"1"] * num_ids) + b"]}"


# -- item 6: the NaN check, the body cap, parsing off the loop ----------------------------------


def test_the_non_finite_check_allocates_nothing_per_element() -> None:
    data = {"input_ids": [1] * 1_000_000, "sampling_params": {"temperature": 0.5}}
    tracemalloc.start()
    try:
        assert find_non_finite(data) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"{peak} bytes for a million ids"
    bad = {"a": [1, {"b": [0.5, float("nan")]}], "c": float("inf")}
    assert find_non_finite(bad) == "a[1].b[1]"
    assert find_non_finite({"c": float("-inf")}) == "c"
    assert find_non_finite([[1.0], [2.0, float("inf")]]) == "[1][1]"
    assert find_non_finite(float("nan")) == "(the body)"


def test_a_body_over_the_cap_gets_a_413_naming_it() -> None:
    cap = DEFAULT_MAX_BODY_BYTES

    async def go() -> tuple[int, dict, int]:
        async with TestClient(TestServer(_front().app())) as http:
            over = b"x" * (cap + 1)  # not even JSON: refused by its size before it is read
            response = await http.post("/generate", data=over)
            got = (response.status, await response.json())
            health = await http.get("/health")
            return (*got, health.status)

    status, reply, health = asyncio.run(go())
    assert status == 413, reply
    assert str(cap) in reply["error"]["message"], reply
    assert "--max-request-body-bytes" in reply["error"]["message"], reply
    assert health == 200


def test_the_body_cap_is_the_flags(tmp_path) -> None:
    from kvstack.serve.limits import FrontLimits

    async def go() -> list[tuple[int, dict]]:
        front = _front(limits=FrontLimits(max_body_bytes=1000))
        out = []
        async with TestClient(TestServer(front.app())) as http:
            for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
                response = await http.post(path, data=b" " * 1001)
                out.append((response.status, await response.json()))
        return out

    for status, reply in asyncio.run(go()):
        assert status == 413, reply
        message = reply["error"]["message"] if "error" in reply else reply["message"]
        assert "1000" in message and "--max-request-body-bytes" in message, reply


def test_health_answers_while_a_large_body_is_parsed() -> None:
    """The largest gap between ``/health`` answers while a 5-million-id body is being
    parsed and validated: the whole parse when it runs on the loop (seconds at
    e09ed5e), a GIL slice of it when it runs in a thread. The bound is generous."""
    body = _ids_body(5_000_000)  # 15 MB, under the default cap; too many ids: a 400

    async def go() -> tuple[int, float, int]:
        async with TestClient(TestServer(_front().app())) as http:
            done = asyncio.Event()
            answers: list[float] = []

            async def poll() -> None:
                while not done.is_set():
                    response = await http.get("/health")
                    assert response.status == 200
                    answers.append(time.monotonic())
                    await asyncio.sleep(0.01)

            poller = asyncio.ensure_future(poll())
            await asyncio.sleep(0.1)
            started = time.monotonic()
            response = await http.post("/generate", data=body)
            status = response.status
            finished = time.monotonic()
            done.set()
            await poller
        during = [t for t in answers if started <= t <= finished]
        edges = [started, *during, finished]
        worst = max(b - a for a, b in itertools.pairwise(edges))
        return status, worst, len(during)

    status, worst_gap, num_answers = asyncio.run(go())
    assert status == 400
    assert worst_gap < 2.5, f"/health waited {worst_gap:.2f} s ({num_answers} answers)"


class _SlowChatTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template, whose ``encode`` takes ``seconds`` (off the
    GIL, as the tokenizers package's does) and is counted."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.num_encoded = seconds, 0

        class Template:
            def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
                return "".join(m["content"] for m in messages)

        self.chat_template = Template()

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        self.num_encoded += 1
        time.sleep(self.seconds)
        return super().encode(text[:100], add_bos=add_bos)


def test_a_chat_is_tokenized_off_the_event_loop() -> None:
    """A 12 MB chat message kept the loop busy for 64-112 s: tokenizing ran on it. Here
    tokenizing takes 3 s, and ``/health`` is asked (from another thread) meanwhile."""
    tokenizer = _SlowChatTokenizer(seconds=3.0)
    body = {"messages": [{"role": "user", "content": "a" * 200_000}], "max_tokens": 1}

    def health_while_tokenizing(url: str) -> tuple[int, float]:
        while tokenizer.num_encoded == 0:
            time.sleep(0.01)
        started = time.monotonic()
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, time.monotonic() - started

    async def go() -> tuple[int, float]:
        front = _front()
        front.tokenizer = tokenizer
        async with TestClient(TestServer(front.app())) as http:
            health = asyncio.ensure_future(
                asyncio.to_thread(health_while_tokenizing, str(http.make_url("/health")))
            )
            chat = asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
            got = await health
            chat.cancel()
            return got

    status, seconds = asyncio.run(go())
    assert status == 200 and seconds < 1.5, f"/health waited {seconds:.2f} s for the tokenizer"


def test_a_chat_longer_than_a_prompt_can_be_is_refused_before_tokenizing() -> None:
    tokenizer = _SlowChatTokenizer(seconds=0.0)
    body = {"messages": [{"role": "user", "content": "a" * ((1 << 20) + 1)}], "max_tokens": 1}

    async def go() -> tuple[int, dict]:
        front = _front()
        front.tokenizer = tokenizer
        async with TestClient(TestServer(front.app())) as http:
            response = await http.post("/v1/chat/completions", json=body)
            return response.status, await response.json()

    status, reply = asyncio.run(go())
    assert status == 400 and reply["param"] == "messages", reply
    assert str(1 << 20) in reply["message"], reply
    assert tokenizer.num_encoded == 0


# -- item 7: batch amplification ------------------------------------------------------------------


async def _post_all(bodies: list[tuple[str, Any]]) -> list[tuple[int, dict]]:
    out = []
    async with TestClient(TestServer(_front().app())) as http:
        for path, body in bodies:
            response = await asyncio.wait_for(http.post(path, json=body), 20)
            out.append((response.status, await response.json()))
    return out


def test_a_batch_is_capped_in_scheduler_requests() -> None:
    """300 prompts × n 64 was 19,200 scheduler requests from a 1.5 KB body."""
    texts = ["a"] * 300
    ids = [[1, 2]] * 300
    bodies = [
        ("/v1/completions", {"prompt": texts, "n": 64, "max_tokens": 1}),
        ("/v1/completions", {"prompt": ids, "n": 64, "max_tokens": 1}),
        ("/generate", {"text": texts, "sampling_params": {"n": 64, "max_new_tokens": 1}}),
        ("/generate", {"input_ids": ids, "sampling_params": {"n": 64}}),
        ("/generate", {"text": ["a"] * 20_000}),  # the list alone, n = 1
        ("/v1/completions", {"prompt": ["a"] * 20_000}),
    ]
    for (path, _), (status, reply) in zip(bodies, asyncio.run(_post_all(bodies)), strict=True):
        message = reply["error"]["message"] if "error" in reply else reply["message"]
        assert status == 400, (path, reply)
        assert re.search(r"at most \d+ .*--max-batch-requests", message), (path, message)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [12345] * 200_000 + [1.5]},
        {"prompt": ["a"] * 10 + [1]},
        {"prompt": [[1, 2]] * 5_000 + [[1.5]]},
    ],
    ids=["ids", "texts", "id lists"],
)
def test_a_bad_prompt_list_gets_one_error_not_one_per_element(body: dict) -> None:
    ((status, reply),) = asyncio.run(_post_all([("/v1/completions", body)]))
    assert status == 400, reply
    assert len(json.dumps(reply)) < 2000, f"{len(json.dumps(reply))} bytes of error"
