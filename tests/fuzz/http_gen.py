"""Requests for ``kvstack serve``'s HTTP front: SGLang's native API, mutated.

A message is ``(method, path, body, content_type)``. Bodies are valid
``/generate`` and ``/abort_request`` JSON with fields of wrong types, ints past
int64, floats at float32's edges, deep nesting, bad UTF-8 and plain garbage;
the other endpoints, unknown paths and wrong methods are asked too.
"""

from __future__ import annotations

import json
import random
from typing import Any

from tests.fuzz.mutate import EDGE_INTS, hostile_value, nested

PATHS = ("/generate", "/abort_request", "/health", "/get_server_info", "/metrics")
FLOATS = [0.0, 1e-300, 1e-46, 1.0, 2.0, 1e308, -1.0, 0.5]
HttpRequest = tuple[str, str, bytes, str]


def _jsonable(value: Any) -> Any:
    """``hostile_value`` without what JSON cannot say (bytes, NaN): their nearest relatives."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


class HttpMessages:
    def __init__(self) -> None:
        self.num_sent = 0

    def observe(self, header: dict[str, Any]) -> None:
        pass

    def next(self, rng: random.Random) -> HttpRequest:
        self.num_sent += 1
        roll = rng.random()
        if roll < 0.08:
            path = rng.choice([*PATHS, "/nope", "/generate/../health", "/" + "a" * 300])
            return rng.choice(["GET", "POST", "PUT", "DELETE"]), path, b"", "text/plain"
        if roll < 0.16:
            return "POST", "/generate", self._garbage(rng), "application/json"
        if roll < 0.22:
            body = {"rid": rng.choice(["legit1", "f1", "", "x" * 300]), **self._extra(rng)}
            return "POST", "/abort_request", json.dumps(body).encode(), "application/json"
        body = self._generate(rng)
        if roll > 0.35:
            for _ in range(rng.randint(1, 3)):
                self._mutate(body, rng)
        # Infinity and NaN are not JSON; Python writes them as bare words, a hostile body too.
        data = json.dumps(body, allow_nan=True).encode()
        return "POST", "/generate", data, rng.choice(["application/json"] * 5 + ["text/plain"])

    def _generate(self, rng: random.Random) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": rng.randint(0, 6)}
        if rng.random() < 0.4:
            sampling.update(temperature=rng.choice([0.0, 0.7]), top_p=rng.choice([1.0, 0.9]))
        body: dict[str, Any] = {"sampling_params": sampling, "stream": rng.random() < 0.3}
        if rng.random() < 0.7:
            body["input_ids"] = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        else:
            body["text"] = rng.choice(["hello", "", "\u00e9\u4e2d", "a" * 200])
        if rng.random() < 0.2:
            body["rid"] = rng.choice(["legit1", f"h{self.num_sent}", "h1"])
        return body

    def _mutate(self, body: dict[str, Any], rng: random.Random) -> None:
        kind = rng.randrange(6)
        if kind == 0 and body:
            body.pop(rng.choice(list(body)))
        elif kind == 1:
            body.update(self._extra(rng))
        elif kind == 2:
            body[rng.choice(["input_ids", "text", "stream", "rid", "priority"])] = _jsonable(
                hostile_value(rng)
            )
        elif kind == 3:
            sampling = body.setdefault("sampling_params", {})
            if not isinstance(sampling, dict):
                sampling = body["sampling_params"] = {}
            key = rng.choice(["temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids"])
            sampling[key] = rng.choice([*FLOATS, *EDGE_INTS, 2**70, -(2**70), "1", [2**70]])
        elif kind == 4:
            body["input_ids"] = rng.choice([[2**70], [-1], [1.5], [[1, 2]], nested(50), []])
        else:
            body["sampling_params"] = _jsonable(hostile_value(rng))

    def _extra(self, rng: random.Random) -> dict[str, Any]:
        return {rng.choice(["evil", "bootstrap_room", "lora_path", "x"]): rng.choice(EDGE_INTS)}

    def _garbage(self, rng: random.Random) -> bytes:
        kind = rng.randrange(4)
        if kind == 0:
            return rng.randbytes(rng.randrange(64))
        if kind == 1:
            depth = rng.choice([10, 1000, 100_000])
            return b"[" * depth + b"]" * depth
        if kind == 2:
            return b'{"text": "\xff\xfe"}'
        return rng.choice([b"", b"null", b"[]", b"1", b'"x"', b'{"input_ids": [1,'])
