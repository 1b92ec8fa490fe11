"""``kvstack serve``'s front against hostile bodies (issue 18, defect 7), in process.

Bodies that cannot be parsed or represented (JSON nested past the parser's
recursion limit, integers beyond int64 where the wire carries int64) are the
client's error: 400 with a JSON error, never a 500. None of them reaches the
scheduler, so the front here points at an address where nothing listens.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvstack.serve.app import Backend, HttpFront
from model_svc.tokenizer import ByteTokenizer

HUGE = 2**70
DEEP = 100_000

HOSTILE = [
    ("deeply nested JSON", b"[" * DEEP + b"]" * DEEP, "malformed_json"),
    ("deeply nested object", (b'{"a":' * DEEP) + b"1" + b"}" * DEEP, "malformed_json"),
    ("priority beyond int64", {"input_ids": [1, 2], "priority": HUGE}, "invalid_request"),
    ("priority below int64", {"input_ids": [1, 2], "priority": -HUGE}, "invalid_request"),
    (
        "stop token beyond int64",
        {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [HUGE]}},
        "invalid_request",
    ),
    ("input id beyond int64", {"input_ids": [1, HUGE]}, "invalid_request"),
    ("top_k beyond int64", {"text": "a", "sampling_params": {"top_k": HUGE}}, "invalid_request"),
    (
        "top_p zero in float32",
        {"text": "a", "sampling_params": {"top_p": 1e-46}},
        "invalid_request",
    ),
]


async def _post(body: Any) -> tuple[int, dict]:
    front = HttpFront(
        Backend("ipc:///nonexistent/kvstack-test.sock"), mode="normal", tokenizer=ByteTokenizer()
    )
    async with TestClient(TestServer(front.app())) as http:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await http.post("/generate", data=data)
        return response.status, await response.json()


@pytest.mark.parametrize(
    ("body", "code"), [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE]
)
def test_hostile_bodies_get_a_400_json_error(body, code) -> None:
    status, reply = asyncio.run(_post(body))
    assert (status, reply["error"]["code"]) == (400, code), reply
    assert reply["error"]["message"]
