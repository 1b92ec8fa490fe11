"""Clients of the generate API: :class:`GenerateClient` (sync) and :class:`AsyncGenerateClient`.

``generate`` waits for the result; ``stream`` yields token chunks as they
come and ends with the result; ``abort`` ends a request by rid. A scheduler
that stays silent for ``timeout_s`` raises :class:`memsvc.client.PeerDeadError`
instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import PeerDeadError
from scheduler_svc.protocol import GenSampling


class GenerateError(Exception):
    """The scheduler rejected the request (bad input, too large...); ``status_code`` says how."""

    def __init__(self, code: str, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status_code = status_code


@dataclass(frozen=True)
class Chunk:
    """New output tokens of a streaming request, starting at output position ``offset``."""

    rid: str
    token_ids: list[int]
    offset: int


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    text: str | None
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def finish_reason(self) -> dict[str, Any]:
        return self.meta_info.get("finish_reason", {})


def _request(
    op_id: int,
    input_ids: Sequence[int] | np.ndarray | None,
    text: str | None,
    sampling: GenSampling | dict | None,
    rid: str | None,
    stream: bool,
    priority: int | None,
) -> tuple[str, list[bytes]]:
    rid = rid or uuid.uuid4().hex
    header: dict[str, Any] = {
        "op": "generate",
        "op_id": op_id,
        "rid": rid,
        "stream": stream,
        "sampling": GenSampling.model_validate(sampling or {}).model_dump(),
        "priority": priority,
    }
    arrays = None
    if input_ids is not None:
        arrays = {"input_ids": np.asarray(input_ids, dtype=wire.ARRAY_DTYPE).reshape(-1)}
    else:
        header["text"] = text
    return rid, wire.pack(header, arrays)


def _decode(header: dict[str, Any]) -> Chunk | GenerateResult:
    if not header.get("ok"):
        raise GenerateError(
            header.get("code", "internal"),
            header.get("message", ""),
            int(header.get("status_code", 400)),
        )
    if header["type"] == "chunk":
        return Chunk(header["rid"], list(header["token_ids"]), header["offset"])
    return GenerateResult(
        header["rid"], list(header["output_ids"]), header.get("text"), header["meta_info"]
    )


class GenerateClient:
    def __init__(self, address: str, *, timeout_s: float = 120.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._ctx = zmq.Context()
        self._sock = rpc.dealer(self._ctx, address)
        self._op_ids = itertools.count(1)

    def stream(
        self, input_ids=None, *, text=None, sampling=None, rid=None, priority=None
    ) -> Iterator[Chunk | GenerateResult]:
        """Token chunks as they are generated, then the result."""
        yield from self._run(input_ids, text, sampling, rid, True, priority)

    def generate(
        self, input_ids=None, *, text=None, sampling=None, rid=None, priority=None
    ) -> GenerateResult:
        for item in self._run(input_ids, text, sampling, rid, False, priority):
            if isinstance(item, GenerateResult):
                return item
        raise PeerDeadError(f"scheduler at {self.address} ended the stream without a result")

    def _run(self, input_ids, text, sampling, rid, stream, priority):
        op_id = next(self._op_ids)
        rid, frames = _request(op_id, input_ids, text, sampling, rid, stream, priority)
        self._sock.send_multipart(frames)
        while True:
            if not self._sock.poll(self.timeout_s * 1000):
                raise PeerDeadError(
                    f"scheduler at {self.address} sent nothing for {self.timeout_s:.0f}s "
                    f"about {rid}"
                )
            header = wire.unpack(self._sock.recv_multipart())
            if header.get("op_id") != op_id:
                continue
            item = _decode(header)
            yield item
            if isinstance(item, GenerateResult):
                return

    def abort(self, rid: str) -> bool:
        """Abort ``rid``; True if it was still running or waiting."""
        ctx_sock = rpc.dealer(self._ctx, self.address)
        try:
            op_id = next(self._op_ids)
            reply = rpc.request(
                ctx_sock,
                wire.pack({"op": "abort", "op_id": op_id, "rid": rid}),
                op_id,
                min(self.timeout_s, 10.0),
                1,
            )
        except rpc.NoReplyError as exc:
            raise PeerDeadError(f"scheduler at {self.address}: {exc}") from None
        finally:
            ctx_sock.close(0)
        return bool(reply.get("found"))

    def info(self) -> dict[str, Any]:
        op_id = next(self._op_ids)
        try:
            return rpc.request(
                self._sock,
                wire.pack({"op": "info", "op_id": op_id}),
                op_id,
                min(self.timeout_s, 10.0),
                1,
            )
        except rpc.NoReplyError as exc:
            raise PeerDeadError(f"scheduler at {self.address}: {exc}") from None

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerateClient:
    """Many requests in flight on one socket; a reader task routes replies by op_id."""

    def __init__(self, address: str, *, timeout_s: float = 120.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = rpc.dealer(self._ctx, address)
        self._op_ids = itertools.count(1)
        self._inbox: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            header = wire.unpack(await self._sock.recv_multipart())
            queue = self._inbox.get(header.get("op_id"))
            if queue is not None:
                queue.put_nowait(header)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="generate-client-reader")

    async def stream(
        self, input_ids=None, *, text=None, sampling=None, rid=None, priority=None
    ) -> AsyncIterator[Chunk | GenerateResult]:
        async for item in self._run(input_ids, text, sampling, rid, True, priority):
            yield item

    async def generate(
        self, input_ids=None, *, text=None, sampling=None, rid=None, priority=None
    ) -> GenerateResult:
        async for item in self._run(input_ids, text, sampling, rid, False, priority):
            if isinstance(item, GenerateResult):
                return item
        raise PeerDeadError(f"scheduler at {self.address} ended the stream without a result")

    async def _call(self, header: dict[str, Any]) -> dict[str, Any]:
        op_id = next(self._op_ids)
        async for reply in self._replies(op_id, wire.pack({**header, "op_id": op_id})):
            return reply
        raise AssertionError("unreachable")

    async def _replies(self, op_id: int, frames: list[bytes]) -> AsyncIterator[dict[str, Any]]:
        self._ensure_reader()
        queue: asyncio.Queue = asyncio.Queue()
        self._inbox[op_id] = queue
        try:
            await self._sock.send_multipart(frames)
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), self.timeout_s)
                except TimeoutError:
                    raise PeerDeadError(
                        f"scheduler at {self.address} sent nothing for {self.timeout_s:.0f}s"
                    ) from None
        finally:
            del self._inbox[op_id]

    async def _run(self, input_ids, text, sampling, rid, stream, priority):
        op_id = next(self._op_ids)
        rid, frames = _request(op_id, input_ids, text, sampling, rid, stream, priority)
        async for header in self._replies(op_id, frames):
            item = _decode(header)
            yield item
            if isinstance(item, GenerateResult):
                return

    async def abort(self, rid: str) -> bool:
        return bool((await self._call({"op": "abort", "rid": rid})).get("found"))

    async def info(self) -> dict[str, Any]:
        return await self._call({"op": "info"})

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncGenerateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
