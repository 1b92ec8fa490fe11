"""An in-process stack for deterministic engine tests.

``InProcessMem`` (:mod:`memsvc.inproc`, which the simulator uses too) is
the real memsvc client (same op code, same replies) wired straight to a
:class:`MemService` instead of a socket. ``FakeModel`` answers forward calls
with a token that depends only on the position and the token before it (the
simulator's :func:`~kvstack.sim.worker.next_token`), so a request that
is retracted and re-prefilled must produce the same tokens as one that is
not: the engine's bookkeeping (which tokens are re-sent, at which positions)
is what these tests check; the real model's numerics are checked in
tests/model and the process tests.
"""

from __future__ import annotations

import numpy as np

from kvstack.sim.worker import expected_output, next_token
from memsvc.inproc import InProcessMem
from model_svc.client import ForwardResult

__all__ = ["FakeModel", "InProcessMem", "expected_output", "next_token"]


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
