"""An in-process stack for deterministic engine tests.

``InProcessMem`` is the real memsvc client (same op code, same replies) wired
straight to a :class:`MemService` instead of a socket. ``FakeModel`` answers
forward calls with a token that depends only on the position and the token
before it, so a request that is retracted and re-prefilled must produce the
same tokens as one that is not: the engine's bookkeeping (which tokens are
re-sent, at which positions) is what these tests check; the real model's
numerics are checked in tests/model and the process tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memsvc import protocol as wire
from memsvc.client import _Call, _Client, _Session
from memsvc.handlers import MemService
from model_svc.client import ForwardResult


class InProcessMem(_Client):
    def __init__(self, service: MemService, name: str = "scheduler") -> None:
        self._service = service
        self._state = _Session("inproc://memsvc", "scheduler", name, 3600.0, 1.0, 0, None)

    @classmethod
    async def connect(cls, service: MemService, name: str = "scheduler") -> InProcessMem:
        client = cls(service, name)
        await client._invoke(client._state.hello_call())
        return client

    async def _invoke(self, call: _Call) -> Any:
        _, frames = self._state.frames(call)
        header = wire.unpack(self._service.handle(frames))
        return self._state.finish(call, header)


def next_token(previous: int, position: int) -> int:
    return (previous * 31 + position * 7 + 3) % 250


class FakeModel:
    """Deterministic "model": the next token is a function of (last token, position)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table  # memsvc's req_to_token (host view): checked, like model_svc does
        self.extend_tokens = 0
        self.calls: list[str] = []

    def _check(self, row: int, end: int) -> None:
        slots = self.table[row, :end]
        assert (slots > 0).all(), f"row {row} has no slot below {end}"

    async def extend(self, items, sampling=None, pool_epoch=None) -> ForwardResult:
        self.calls.append("extend")
        out = []
        for row, prefix_len, new in items:
            self._check(row, prefix_len + len(new))
            self.extend_tokens += len(new)
            out.append(next_token(int(new[-1]), prefix_len + len(new) - 1))
        return ForwardResult(np.array(out, dtype=np.int64))

    async def decode(self, rows, seq_lens, token_ids, sampling=None, pool_epoch=None):
        self.calls.append("decode")
        for row, seq_len in zip(rows, seq_lens, strict=True):
            self._check(row, seq_len)
        out = [next_token(int(t), int(s) - 1) for t, s in zip(token_ids, seq_lens, strict=True)]
        return ForwardResult(np.array(out, dtype=np.int64))


def expected_output(prompt: list[int], max_new: int) -> list[int]:
    """What FakeModel generates for ``prompt`` with no stop token."""
    out, last, position = [], prompt[-1], len(prompt) - 1
    for _ in range(max_new):
        last = next_token(last, position)
        out.append(last)
        position += 1
    return out
