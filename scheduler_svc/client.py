"""Clients of the generate API: :class:`GenerateClient` (sync) and :class:`AsyncGenerateClient`.

``generate`` waits for the result; ``stream`` yields token chunks as they
come (each with its ``meta_info``: the counts so far and, with
``return_logprob``, the new tokens' logprobs) and ends with the result;
``abort`` ends a request by rid; ``flush_cache`` empties the prefix cache if
nothing runs or waits (``(flushed, message)``). ``return_logprob``,
``logprob_start_len`` and ``top_logprobs_num`` are SGLang's (see
:mod:`scheduler_svc.protocol`).

A scheduler that dies (its socket disconnects, seen at once through a ZMQ
socket monitor) or stays silent for ``timeout_s`` does not lose the request:
the client sends it again under the same rid, up to ``resubmits`` times (to
the restarted scheduler, or to the same one after a stall: a scheduler that
still runs the rid attaches the re-submission to it, one that finished it
answers from its result cache). Chunks already delivered are never
delivered twice: a re-submitted stream starts again at offset 0 and the
client drops what it already gave out. When every re-submission fails,
:class:`SchedulerLostError` (a :class:`GenerateError` and a
:class:`memsvc.client.PeerDeadError`) names the faults; it never hangs.

``curve``: the keys for a scheduler (or router) that serves with CURVE; one
that does not accept them never answers, which ends the same way.

Each client has a ``client_id`` (random unless given) that it sends with every
``generate`` and ``abort``: the scheduler lets only the client that submitted a
rid re-submit it or abort it. Keep it (pass it to the next client) to take a
request over from a new process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from scheduler_svc.protocol import GenSampling


class GenerateError(Exception):
    """The scheduler rejected the request (bad input, too large...); ``status_code`` says how."""

    def __init__(self, code: str, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status_code = status_code


class SchedulerLostError(GenerateError, PeerDeadError):
    """The scheduler died or went silent, and re-submitting the request did not help."""

    def __init__(self, address: str, rid: str, faults: list[str]) -> None:
        GenerateError.__init__(
            self,
            "scheduler_unavailable",
            f"scheduler at {address} lost request {rid!r} {len(faults)} times "
            f"({'; '.join(faults)}); gave up",
            503,
        )
        self.faults = list(faults)


class _Fault(Exception):
    """This try of a request failed (disconnect, silence, lost chunk): send it again."""


DEFAULT_RESUBMITS = 3


@dataclass(frozen=True)
class Chunk:
    """New output tokens of a streaming request, starting at output position ``offset``."""

    rid: str
    token_ids: list[int]
    offset: int
    meta_info: dict[str, Any] = field(default_factory=dict)


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
    client: str,
    op_id: int,
    input_ids: Sequence[int] | np.ndarray | None,
    text: str | None,
    sampling: GenSampling | dict | None,
    rid: str | None,
    stream: bool,
    priority: int | None,
    logprobs: LogprobArgs | None = None,
) -> tuple[str, list[bytes]]:
    rid = rid or uuid.uuid4().hex
    header: dict[str, Any] = {
        "op": "generate",
        "op_id": op_id,
        "rid": rid,
        "client": client,
        "stream": stream,
        "sampling": GenSampling.model_validate(sampling or {}).model_dump(),
        "priority": priority,
    }
    if logprobs is not None and logprobs.return_logprob:
        header.update(logprobs._asdict())
    arrays = None
    if input_ids is not None:
        arrays = {"input_ids": np.asarray(input_ids, dtype=wire.ARRAY_DTYPE).reshape(-1)}
    else:
        header["text"] = text
    return rid, wire.pack(header, arrays)


class LogprobArgs(NamedTuple):
    """SGLang's logprob fields of a generate."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


def _unpack(frames: list[bytes]) -> dict[str, Any] | None:
    """A reply's header, or None for one damaged in transit (no reply, as if lost)."""
    try:
        return wire.unpack(frames)
    except wire.ProtocolError:
        return None


def _fresh(chunk: Chunk, delivered: int) -> Chunk | None:
    """The part of ``chunk`` past the ``delivered`` tokens given out already (None: nothing).

    A chunk that starts after them means one was lost: :class:`_Fault`.
    """
    if chunk.offset > delivered:
        raise _Fault(f"stream chunk at {delivered} lost (got offset {chunk.offset})")
    skip = delivered - chunk.offset
    if skip >= len(chunk.token_ids):
        return None
    if skip == 0:
        return chunk
    meta = {k: v for k, v in chunk.meta_info.items() if not k.startswith("input_")}
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            meta[key] = meta[key][skip:]
    return Chunk(chunk.rid, chunk.token_ids[skip:], delivered, meta)


def _flushed(reply: dict[str, Any]) -> tuple[bool, str]:
    """A flush_cache's answer; an error reply raises."""
    if not reply.get("ok"):
        raise GenerateError(
            reply.get("code", "internal"),
            reply.get("message", ""),
            int(reply.get("status_code", 400)),
        )
    return bool(reply.get("flushed")), str(reply.get("message", ""))


def _drain(monitor: zmq.Socket) -> None:
    """Forget disconnects that happened before this try (they are not about it)."""
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


def _found(reply: dict[str, Any]) -> bool:
    """An abort's answer: whether the rid was live; an error reply raises."""
    if not reply.get("ok"):
        raise GenerateError(
            reply.get("code", "internal"),
            reply.get("message", ""),
            int(reply.get("status_code", 400)),
        )
    return bool(reply.get("found"))


def _decode(header: dict[str, Any]) -> Chunk | GenerateResult:
    if not header.get("ok"):
        raise GenerateError(
            header.get("code", "internal"),
            header.get("message", ""),
            int(header.get("status_code", 400)),
        )
    if header["type"] == "chunk":
        return Chunk(
            header["rid"],
            list(header["token_ids"]),
            header["offset"],
            dict(header.get("meta_info") or {}),
        )
    return GenerateResult(
        header["rid"], list(header["output_ids"]), header.get("text"), header["meta_info"]
    )


class GenerateClient:
    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 120.0,
        resubmits: int = DEFAULT_RESUBMITS,
        curve: CurveClientKeys | None = None,
        client_id: str | None = None,
    ) -> None:
        self.address, self.timeout_s, self.resubmits = address, timeout_s, resubmits
        self.client_id = client_id or secrets.token_hex(16)  # who owns the rids it submits
        self.curve = curve
        self._ctx = zmq.Context()
        self._sock = rpc.dealer(self._ctx, address, curve)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._op_ids = itertools.count(1)

    def stream(
        self,
        input_ids=None,
        *,
        text=None,
        sampling=None,
        rid=None,
        priority=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
    ) -> Iterator[Chunk | GenerateResult]:
        """Token chunks as they are generated, then the result."""
        logprobs = LogprobArgs(return_logprob, logprob_start_len, top_logprobs_num)
        yield from self._run(input_ids, text, sampling, rid, True, priority, logprobs)

    def generate(
        self,
        input_ids=None,
        *,
        text=None,
        sampling=None,
        rid=None,
        priority=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
    ) -> GenerateResult:
        logprobs = LogprobArgs(return_logprob, logprob_start_len, top_logprobs_num)
        for item in self._run(input_ids, text, sampling, rid, False, priority, logprobs):
            if isinstance(item, GenerateResult):
                return item
        raise PeerDeadError(f"scheduler at {self.address} ended the stream without a result")

    def _run(self, input_ids, text, sampling, rid, stream, priority, logprobs=None):
        rid = rid or uuid.uuid4().hex
        delivered = [0]  # output tokens given out (a list: _try updates it)
        faults: list[str] = []
        while True:
            op_id = next(self._op_ids)
            _, frames = _request(
                self.client_id, op_id, input_ids, text, sampling, rid, stream, priority, logprobs
            )
            _drain(self._monitor)
            rpc.send_or_drop(self._sock, frames)  # dropped (CURVE refused us): a silent try
            try:
                yield from self._try(op_id, rid, delivered)
                return
            except _Fault as fault:
                faults.append(str(fault))
            if len(faults) > self.resubmits:
                raise SchedulerLostError(self.address, rid, faults)

    def _try(self, op_id: int, rid: str, delivered: list[int]):
        """Replies to ``op_id`` until the result; :class:`_Fault` when this try is lost."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self.timeout_s * 1000))
            if self._monitor in ready:
                raise _Fault("connection lost")
            if not ready:
                raise _Fault(f"sent nothing for {self.timeout_s:.0f}s about {rid}")
            header = _unpack(self._sock.recv_multipart())
            if header is None or header.get("op_id") != op_id:
                continue
            item = _decode(header)
            if isinstance(item, Chunk):
                item = _fresh(item, delivered[0])
                if item is None:
                    continue
                delivered[0] += len(item.token_ids)
            yield item
            if isinstance(item, GenerateResult):
                return

    def abort(self, rid: str) -> bool:
        """Abort ``rid``; True if it was still running or waiting. Another client's rid
        raises :class:`GenerateError` (``not_owner``)."""
        ctx_sock = rpc.dealer(self._ctx, self.address, self.curve)
        try:
            op_id = next(self._op_ids)
            reply = rpc.request(
                ctx_sock,
                wire.pack({"op": "abort", "op_id": op_id, "rid": rid, "client": self.client_id}),
                op_id,
                min(self.timeout_s, 10.0),
                1,
            )
        except rpc.NoReplyError as exc:
            raise PeerDeadError(f"scheduler at {self.address}: {exc}") from None
        finally:
            ctx_sock.close(0)
        return _found(reply)

    def info(self) -> dict[str, Any]:
        return self._call({"op": "info"})

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache; ``(False, why)`` while requests run or wait."""
        return _flushed(self._call({"op": "flush_cache"}, timeout_s=self.timeout_s))

    def _call(self, header: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        op_id = next(self._op_ids)
        try:
            return rpc.request(
                self._sock,
                wire.pack({**header, "op_id": op_id}),
                op_id,
                timeout_s or min(self.timeout_s, 10.0),
                1,
            )
        except rpc.NoReplyError as exc:
            raise PeerDeadError(f"scheduler at {self.address}: {exc}") from None

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerateClient:
    """Many requests in flight on one socket; a reader task routes replies by op_id."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 120.0,
        resubmits: int = DEFAULT_RESUBMITS,
        curve: CurveClientKeys | None = None,
        client_id: str | None = None,
    ) -> None:
        self.address, self.timeout_s, self.resubmits = address, timeout_s, resubmits
        self.client_id = client_id or secrets.token_hex(16)  # who owns the rids it submits
        self._ctx = zmq.asyncio.Context()
        self._sock = rpc.dealer(self._ctx, address, curve)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._op_ids = itertools.count(1)
        self._inbox: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            header = _unpack(await self._sock.recv_multipart())
            queue = self._inbox.get(header.get("op_id")) if header is not None else None
            if queue is not None:
                queue.put_nowait(header)

    async def _watch(self) -> None:
        """Every disconnect ends the current try of every request in flight."""
        while True:
            await self._monitor.recv_multipart()
            for queue in self._inbox.values():
                queue.put_nowait(None)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="generate-client-reader")
            self._watcher = asyncio.create_task(self._watch(), name="generate-client-watch")

    async def stream(
        self,
        input_ids=None,
        *,
        text=None,
        sampling=None,
        rid=None,
        priority=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
    ) -> AsyncIterator[Chunk | GenerateResult]:
        logprobs = LogprobArgs(return_logprob, logprob_start_len, top_logprobs_num)
        async for item in self._run(input_ids, text, sampling, rid, True, priority, logprobs):
            yield item

    async def generate(
        self,
        input_ids=None,
        *,
        text=None,
        sampling=None,
        rid=None,
        priority=None,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
    ) -> GenerateResult:
        logprobs = LogprobArgs(return_logprob, logprob_start_len, top_logprobs_num)
        async for item in self._run(input_ids, text, sampling, rid, False, priority, logprobs):
            if isinstance(item, GenerateResult):
                return item
        raise PeerDeadError(f"scheduler at {self.address} ended the stream without a result")

    async def _call(self, header: dict[str, Any]) -> dict[str, Any]:
        op_id = next(self._op_ids)
        try:
            async for reply in self._replies(op_id, wire.pack({**header, "op_id": op_id})):
                return reply
        except _Fault as fault:
            raise PeerDeadError(f"scheduler at {self.address}: {fault}") from None
        raise AssertionError("unreachable")

    async def _replies(self, op_id: int, frames: list[bytes]) -> AsyncIterator[dict[str, Any]]:
        """Replies to ``op_id``; :class:`_Fault` on a disconnect or ``timeout_s`` of silence."""
        self._ensure_reader()
        queue: asyncio.Queue = asyncio.Queue()
        self._inbox[op_id] = queue
        try:
            with contextlib.suppress(zmq.Again):  # as rpc.send_or_drop: a silent try
                await self._sock.send_multipart(frames, zmq.NOBLOCK)
            while True:
                try:
                    header = await asyncio.wait_for(queue.get(), self.timeout_s)
                except TimeoutError:
                    raise _Fault(f"sent nothing for {self.timeout_s:.0f}s") from None
                if header is None:
                    raise _Fault("connection lost")
                yield header
        finally:
            del self._inbox[op_id]

    async def _run(self, input_ids, text, sampling, rid, stream, priority, logprobs=None):
        rid = rid or uuid.uuid4().hex
        delivered = 0  # output tokens given out
        faults: list[str] = []
        while True:
            op_id = next(self._op_ids)
            _, frames = _request(
                self.client_id, op_id, input_ids, text, sampling, rid, stream, priority, logprobs
            )
            replies = self._replies(op_id, frames)
            try:
                async with contextlib.aclosing(replies):
                    async for header in replies:
                        item = _decode(header)
                        if isinstance(item, Chunk):
                            item = _fresh(item, delivered)
                            if item is None:
                                continue
                            delivered += len(item.token_ids)
                        yield item
                        if isinstance(item, GenerateResult):
                            return
            except _Fault as fault:
                faults.append(str(fault))
            if len(faults) > self.resubmits:
                raise SchedulerLostError(self.address, rid, faults)

    async def abort(self, rid: str) -> bool:
        """Abort ``rid``; True if it was still running or waiting. Another client's rid
        raises :class:`GenerateError` (``not_owner``)."""
        return _found(await self._call({"op": "abort", "rid": rid, "client": self.client_id}))

    async def info(self) -> dict[str, Any]:
        return await self._call({"op": "info"})

    async def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache; ``(False, why)`` while requests run or wait."""
        return _flushed(await self._call({"op": "flush_cache"}))

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncGenerateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
