"""A simulated model worker: deterministic tokens, a simulated clock, no compute.

:class:`SimWorker` has the two calls the engine makes of
:class:`~model_svc.client.AsyncModelClient` (``extend`` and ``decode``, same
arguments, a result with ``next_token_ids``), so the engine runs unchanged.
Instead of running a model it advances :class:`SimClock` by the cost model.

Tokens are a function of (previous token, its position) only (see
:func:`next_token`), like the engine tests' fake model: a request that is
retracted and re-prefilled must produce exactly the tokens it would have
produced anyway, so lost or repeated tokens show up as wrong outputs. Tokens
are always below :data:`VOCAB`; :data:`EOS` is emitted only where the
runner asks for it (a request whose actual output is shorter than its
``max_new_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstack.sim.costmodel import CostModel, SimClock
from model_svc.client import ForwardResult

VOCAB = 250  # ordinary tokens are 0..VOCAB-1
EOS = VOCAB  # never produced by next_token

# rows -> the total length (prompt + output, EOS included) each request stops at,
# or a negative number for "never" (it runs to max_new_tokens).
StopLengths = Callable[[Sequence[int]], np.ndarray]


def next_token(previous: int, position: int) -> int:
    """The token after ``previous``, which sits at ``position``."""
    return (previous * 31 + position * 7 + 3) % VOCAB


def next_tokens(previous: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """:func:`next_token` over arrays."""
    return (previous * 31 + positions * 7 + 3) % VOCAB


def expected_output(prompt: Sequence[int], max_new: int, stop_len: int = -1) -> list[int]:
    """What the worker generates for ``prompt``: ``max_new`` tokens, or up to EOS."""
    out: list[int] = []
    last, position = prompt[-1], len(prompt) - 1
    for _ in range(max_new):
        position += 1
        last = EOS if position + 1 == stop_len else next_token(last, position - 1)
        out.append(last)
        if last == EOS:
            break
    return out


class SimWorker:
    """The engine's model client, simulated.

    ``table`` (memsvc's ``req_to_token``, host view) makes every call check
    that the positions it would read have KV slots, as model_svc does; it
    costs time proportional to the context, so the tests use it and the
    CLI does not. ``stop_lengths`` places EOS (see :data:`StopLengths`).
    """

    def __init__(
        self,
        clock: SimClock,
        cost: CostModel,
        *,
        stop_lengths: StopLengths | None = None,
        table: np.ndarray | None = None,
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.stop_lengths = stop_lengths
        self.table = table
        self.num_extend_calls = self.num_decode_calls = 0

    async def extend(
        self,
        items: Sequence[tuple[int, int, Sequence[int]]],
        sampling: Any = None,
        pool_epoch: str | None = None,
    ) -> ForwardResult:
        self.num_extend_calls += 1
        self.clock.charge("prefill", self.cost.prefill_seconds([(p, len(n)) for _, p, n in items]))
        rows = np.array([row for row, _, _ in items], dtype=np.int64)
        # The sampled token follows the last new token, at position prefix + len(new) - 1.
        ends = np.array([prefix + len(new) for _, prefix, new in items], dtype=np.int64)
        last = np.array([int(new[-1]) for _, _, new in items], dtype=np.int64)
        self._check(rows, ends)
        return ForwardResult(self._sample(rows, last, ends))

    async def decode(
        self,
        rows: Sequence[int],
        seq_lens: Sequence[int],
        token_ids: Sequence[int],
        sampling: Any = None,
        pool_epoch: str | None = None,
    ) -> ForwardResult:
        self.num_decode_calls += 1
        rows_a = np.asarray(rows, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        self.clock.charge("decode", self.cost.decode_seconds(len(rows_a), int(lens.sum())))
        self._check(rows_a, lens)
        return ForwardResult(self._sample(rows_a, np.asarray(token_ids, dtype=np.int64), lens))

    def _sample(self, rows: np.ndarray, last: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """The token at position ``seq_len`` of each row (EOS where its request stops)."""
        out = next_tokens(last, seq_lens - 1)
        if self.stop_lengths is not None:
            out[self.stop_lengths(rows) == seq_lens + 1] = EOS
        return out

    def _check(self, rows: np.ndarray, ends: np.ndarray) -> None:
        if self.table is None:
            return
        for row, end in zip(rows.tolist(), ends.tolist(), strict=True):
            if not (self.table[row, :end] > 0).all():
                raise AssertionError(f"row {row} has no KV slot below {end}")
