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

Both clients run the same request logic, which does no I/O
(:mod:`scheduler_svc.generation`); each only sends frames and waits for replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from memsvc import protocol as wire
from memsvc import rpc
from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from scheduler_svc.generation import (
    DEFAULT_RESUBMITS,
    Bootstrap,
    CacheKeys,
    Chunk,
    Fault,
    GenerateError,
    GenerateResult,
    Generation,
    LogprobArgs,
    SchedulerLostError,
    flushed,
    found,
    unpack_reply,
)

__all__ = [
    "DEFAULT_RESUBMITS",
    "AsyncGenerateClient",
    "CacheKeys",
    "Chunk",
    "GenerateClient",
    "GenerateError",
    "GenerateResult",
    "LogprobArgs",
    "SchedulerLostError",
]


def _flush_header(cache_salt: str | None, extra_key: str | None) -> dict[str, Any]:
    keys = {"cache_salt": cache_salt, "extra_key": extra_key}
    return {"op": "flush_cache", **{k: v for k, v in keys.items() if v is not None}}


def _drain(monitor: zmq.Socket) -> None:
    """Forget disconnects that happened before this try (they are not about it)."""
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


_Stream = TypeVar("_Stream")
_Result = TypeVar("_Result")


class GenerateAPI(Generic[_Stream, _Result]):
    """What both clients share: the socket and its disconnect monitor, the client id,
    ``stream`` and ``generate``; a transport (:class:`GenerateClient` blocking,
    :class:`AsyncGenerateClient` on asyncio) runs each :class:`Generation`."""

    _new_context: Callable[[], zmq.Context] = zmq.Context

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
        self._ctx = self._new_context()
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
        cache_salt=None,
        extra_key=None,
        bootstrap_room=None,
        bootstrap_peer=None,
        bootstrap_rid=None,
    ) -> _Stream:
        """Token chunks as they are generated, then the result."""
        logprobs = LogprobArgs(return_logprob, logprob_start_len, top_logprobs_num)
        keys = CacheKeys(cache_salt, extra_key)
        bootstrap = Bootstrap(bootstrap_room, bootstrap_peer, bootstrap_rid)
        return self._stream(
            partial(
                Generation,
                self,
                input_ids,
                text,
                sampling,
                rid,
                True,
                priority,
                logprobs,
                keys,
                bootstrap,
            )
        )

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
        cache_salt=None,
        extra_key=None,
    ) -> _Result:
        """The result."""
        logprobs = LogprobArgs(return_logprob, logprob_start_len, top_logprobs_num)
        keys = CacheKeys(cache_salt, extra_key)
        return self._generate(
            partial(
                Generation, self, input_ids, text, sampling, rid, False, priority, logprobs, keys
            )
        )

    # A transport's: run the generation ``start()`` makes (when the caller first asks:
    # a bad request raises where it did before, at the first item or the await).
    def _stream(self, start: Callable[[], Generation]) -> _Stream:
        raise NotImplementedError

    def _generate(self, start: Callable[[], Generation]) -> _Result:
        raise NotImplementedError

    def _no_result(self) -> PeerDeadError:
        return PeerDeadError(f"scheduler at {self.address} ended the stream without a result")

    def _dead(self, why: object) -> PeerDeadError:
        return PeerDeadError(f"scheduler at {self.address}: {why}")

    def _close_sockets(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()


class GenerateClient(GenerateAPI[Iterator[Chunk | GenerateResult], GenerateResult]):
    def _generate(self, start: Callable[[], Generation]) -> GenerateResult:
        for item in self._stream(start):
            if isinstance(item, GenerateResult):
                return item
        raise self._no_result()

    def _stream(self, start: Callable[[], Generation]) -> Iterator[Chunk | GenerateResult]:
        generation = start()
        while True:
            op_id = next(self._op_ids)
            _drain(self._monitor)
            # dropped (CURVE refused us): a silent try
            rpc.send_or_drop(self._sock, generation.frames(op_id))
            try:
                yield from self._try(op_id, generation)
                return
            except Fault as fault:
                generation.lost(fault)

    def _try(self, op_id: int, generation: Generation) -> Iterator[Chunk | GenerateResult]:
        """What the replies to ``op_id`` give out, until the result; :class:`Fault` when
        this try is lost."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self.timeout_s * 1000))
            if self._monitor in ready:
                raise Fault("connection lost")
            if not ready:
                raise Fault(f"sent nothing for {self.timeout_s:.0f}s about {generation.rid}")
            header = unpack_reply(self._sock.recv_multipart())
            if header is None or header.get("op_id") != op_id:
                continue
            item = generation.take(header)
            if item is not None:
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
            raise self._dead(exc) from None
        finally:
            ctx_sock.close(0)
        return found(reply)

    def info(self) -> dict[str, Any]:
        return self._call({"op": "info"})

    def flush_cache(self, cache_salt=None, extra_key=None) -> tuple[bool, str]:
        """Empty the prefix cache; ``(False, why)`` while requests run or wait. With a
        cache key: only that namespace's cached KV, whatever runs."""
        header = _flush_header(cache_salt, extra_key)
        return flushed(self._call(header, timeout_s=self.timeout_s))

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
            raise self._dead(exc) from None

    def close(self) -> None:
        self._close_sockets()

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGenerateClient(
    GenerateAPI[AsyncIterator[Chunk | GenerateResult], Awaitable[GenerateResult]]
):
    """Many requests in flight on one socket; a reader task routes replies by op_id."""

    _new_context = zmq.asyncio.Context

    def __init__(self, address: str, **options: Any) -> None:
        """``options``: as :class:`GenerateClient`'s."""
        super().__init__(address, **options)
        self._inbox: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            header = unpack_reply(await self._sock.recv_multipart())
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

    async def _generate(self, start: Callable[[], Generation]) -> GenerateResult:
        async for item in self._stream(start):
            if isinstance(item, GenerateResult):
                return item
        raise self._no_result()

    async def _stream(
        self, start: Callable[[], Generation]
    ) -> AsyncIterator[Chunk | GenerateResult]:
        generation = start()
        while True:
            op_id = next(self._op_ids)
            replies = self._replies(op_id, generation.frames(op_id))
            try:
                async with contextlib.aclosing(replies):
                    async for header in replies:
                        item = generation.take(header)
                        if item is not None:
                            yield item
                        if isinstance(item, GenerateResult):
                            return
            except Fault as fault:
                generation.lost(fault)

    async def _call(self, header: dict[str, Any]) -> dict[str, Any]:
        op_id = next(self._op_ids)
        try:
            async for reply in self._replies(op_id, wire.pack({**header, "op_id": op_id})):
                return reply
        except Fault as fault:
            raise self._dead(fault) from None
        raise AssertionError("unreachable")

    async def _replies(self, op_id: int, frames: list[bytes]) -> AsyncIterator[dict[str, Any]]:
        """Replies to ``op_id``; :class:`Fault` on a disconnect or ``timeout_s`` of silence."""
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
                    raise Fault(f"sent nothing for {self.timeout_s:.0f}s") from None
                if header is None:
                    raise Fault("connection lost")
                yield header
        finally:
            del self._inbox[op_id]

    async def abort(self, rid: str, *, as_client: str | None = None) -> bool:
        """Abort ``rid``; True if it was still running or waiting. Another client's rid
        raises :class:`GenerateError` (``not_owner``). ``as_client``: the owner's id, for
        a node that passes its client's abort on (a moved request's)."""
        header = {"op": "abort", "rid": rid, "client": as_client or self.client_id}
        return found(await self._call(header))

    async def open_call(
        self, header: dict[str, Any], arrays: dict[str, Any] | None = None
    ) -> tuple[int, asyncio.Queue]:
        """Send ``header`` (and its int64 ``arrays``) under a new op id; returns the op id
        and the queue its raw replies arrive in (None: the connection dropped) until
        :meth:`close_call`. No retry: for a peer that relays the replies itself (a moved
        request's)."""
        self._ensure_reader()
        op_id = next(self._op_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._inbox[op_id] = queue
        with contextlib.suppress(zmq.Again):  # as _replies: a silent try
            await self._sock.send_multipart(
                wire.pack({**header, "client": self.client_id, "op_id": op_id}, arrays),
                zmq.NOBLOCK,
            )
        return op_id, queue

    def close_call(self, op_id: int) -> None:
        self._inbox.pop(op_id, None)

    async def info(self) -> dict[str, Any]:
        return await self._call({"op": "info"})

    async def flush_cache(self, cache_salt=None, extra_key=None) -> tuple[bool, str]:
        """Empty the prefix cache; ``(False, why)`` while requests run or wait. With a
        cache key: only that namespace's cached KV, whatever runs."""
        return flushed(await self._call(_flush_header(cache_salt, extra_key)))

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._close_sockets()

    async def __aenter__(self) -> AsyncGenerateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
