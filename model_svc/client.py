"""Clients of the model worker: :class:`ModelClient` (sync) and :class:`AsyncModelClient`.

Both retry a forward call with the same ``op_id`` on a timeout (forward
passes are idempotent) and raise :class:`memsvc.client.PeerDeadError` when
the worker stays silent, never hanging. ``curve``: the keys for a worker that
serves with CURVE (one that does not accept them never answers).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from model_svc.errors import ModelSvcError
from model_svc.protocol import SamplingSpec


class ForwardError(ModelSvcError):
    """The worker refused or failed a request; ``code`` says why (e.g. ``invalid_batch``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ForwardResult:
    next_token_ids: np.ndarray  # one per request, in batch order
    logprobs: list[float | None] | None = None
    # Per request: None, or [top logprobs, their token ids] (SamplingSpec.top_logprobs_num).
    top_logprobs: list[list[list] | None] | None = None
    # extend with logprob_starts: per request None, or {"logprobs": [...], "top": [...] | None},
    # one entry per position from its start (the last: the sampling position).
    input_logprobs: list[dict[str, Any] | None] | None = None


def _specs(sampling: Sequence[SamplingSpec | dict] | None) -> list[dict] | None:
    if sampling is None:
        return None
    return [SamplingSpec.model_validate(s).model_dump() for s in sampling]


def _ids(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=wire.ARRAY_DTYPE).reshape(-1)


class _Ops:
    """The worker's ops as (header, arrays) pairs; subclasses send them."""

    def _invoke(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None) -> Any:
        raise NotImplementedError

    def info(self) -> Any:
        return self._invoke({"op": "info"}, None)

    def extend(
        self,
        items: Sequence[tuple[int, int, Sequence[int] | np.ndarray]],
        sampling: Sequence[SamplingSpec | dict] | None = None,
        pool_epoch: str | None = None,
        logprob_starts: Sequence[int] | None = None,
        next_token_ids: Sequence[int] | None = None,
    ) -> Any:
        """Compute each ``(row, prefix_len, new_token_ids)``; returns a ForwardResult.

        ``logprob_starts`` / ``next_token_ids``: input logprobs (see
        :class:`model_svc.protocol.Extend`).
        """
        tokens = [_ids(new) for _, _, new in items]
        arrays = {
            "rows": _ids([row for row, _, _ in items]),
            "prefix_lens": _ids([prefix for _, prefix, _ in items]),
            "num_tokens": _ids([t.size for t in tokens]),
            "token_ids": np.concatenate(tokens) if tokens else _ids([]),
        }
        if logprob_starts is not None:
            arrays["logprob_starts"] = _ids(logprob_starts)
        if next_token_ids is not None:
            arrays["next_token_ids"] = _ids(next_token_ids)
        header = {"op": "extend", "sampling": _specs(sampling), "pool_epoch": pool_epoch}
        return self._invoke(header, arrays)

    def decode(
        self,
        rows: Sequence[int] | np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        token_ids: Sequence[int] | np.ndarray,
        sampling: Sequence[SamplingSpec | dict] | None = None,
        pool_epoch: str | None = None,
    ) -> Any:
        """One token per request, ``token_ids[i]`` at position ``seq_lens[i] - 1``."""
        arrays = {"rows": _ids(rows), "seq_lens": _ids(seq_lens), "token_ids": _ids(token_ids)}
        header = {"op": "decode", "sampling": _specs(sampling), "pool_epoch": pool_epoch}
        return self._invoke(header, arrays)


def _result(header: dict[str, Any]) -> Any:
    if not header.get("ok"):
        raise ForwardError(header.get("code", "internal"), header.get("message", ""))
    if "next_token_ids" in header:
        return ForwardResult(
            header["next_token_ids"],
            header.get("logprobs"),
            header.get("top_logprobs"),
            header.get("input_logprobs"),
        )
    return header


class _Transport(_Ops):
    """The socket and the op ids both clients keep; each sends and awaits its own way."""

    _new_context: Callable[[], zmq.Context] = zmq.Context

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 1,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.address, self.timeout_s, self.retries = address, timeout_s, retries
        self._ctx = self._new_context()
        self._sock = rpc.dealer(self._ctx, address, curve)
        self._op_ids = itertools.count(1)

    def _frames(
        self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None
    ) -> tuple[int, list[bytes]]:
        op_id = next(self._op_ids)
        return op_id, wire.pack({**header, "op_id": op_id}, arrays)

    def _dead(self, exc: rpc.NoReplyError) -> PeerDeadError:
        return PeerDeadError(f"model_svc at {self.address}: {exc}")

    def _close_socket(self) -> None:
        self._sock.close(0)
        self._ctx.term()


class ModelClient(_Transport):
    def _invoke(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None) -> Any:
        op_id, frames = self._frames(header, arrays)
        try:
            reply = rpc.request(self._sock, frames, op_id, self.timeout_s, self.retries)
        except rpc.NoReplyError as exc:
            raise self._dead(exc) from None
        return _result(reply)

    def close(self) -> None:
        self._close_socket()

    def __enter__(self) -> ModelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncModelClient(_Transport):
    _new_context = zmq.asyncio.Context

    def __init__(self, address: str, **options: Any) -> None:
        """``options``: as :class:`ModelClient`'s."""
        super().__init__(address, **options)
        self._lock = asyncio.Lock()

    async def _invoke(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None) -> Any:
        op_id, frames = self._frames(header, arrays)
        async with self._lock:
            try:
                reply = await rpc.request_async(
                    self._sock, frames, op_id, self.timeout_s, self.retries
                )
            except rpc.NoReplyError as exc:
                raise self._dead(exc) from None
        return _result(reply)

    async def close(self) -> None:
        self._close_socket()

    async def __aenter__(self) -> AsyncModelClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
