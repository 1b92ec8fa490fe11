"""The one request path of ``kvstack serve``, which both endpoint families go through.

:class:`RequestPath` owns what reaches the scheduler: the clients (one for
generation, with a long timeout; one for info and aborts, with a short one),
the rids in flight, and the front's request metrics. SGLang's native
endpoints (:mod:`kvstack.serve.sglang`) and the OpenAI-compatible ones
(:mod:`kvstack.serve.openai`) are given it and use it alike: a body read
within the limits and parsed (:meth:`~RequestPath.parsed`), each prompt and
sample one scheduler request (:meth:`~RequestPath.events`), streamed from the
scheduler so that the front measures SGLang's time to first token and
inter-token latency also for requests answered whole; their results
(:meth:`~RequestPath.results`) or their items as they come
(:meth:`~RequestPath.firsts`, :meth:`~RequestPath.merged`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from kvstack.serve.body import decode_json, read_body
from kvstack.serve.cache_keys import KEY_FIELDS
from kvstack.serve.connections import ConnectionGuard
from kvstack.serve.errors import ApiError, http_status
from kvstack.serve.limits import INLINE_PARSE_BYTES, OFFLOAD_CONCURRENCY, FrontLimits
from kvstack.serve.metrics import FrontMetrics
from kvstack.serve.pairing import NoPairing
from kvstack.serve.streaming import Item
from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from scheduler_svc.client import AsyncGenerateClient, GenerateError, GenerateResult

if TYPE_CHECKING:
    from kvstack.serve.sglang.protocol import GenerateOne

log = logging.getLogger("kvstack.http")
T = TypeVar("T")

NO_RESULT = "the scheduler ended without a result"


class RequestPath:
    """Bodies in, scheduler requests out: what both endpoint families share."""

    def __init__(
        self,
        scheduler: str,
        *,
        curve: CurveClientKeys | None,
        metrics: FrontMetrics,
        limits: FrontLimits,
        connections: ConnectionGuard,
        request_timeout_s: float,
        control_timeout_s: float,
    ) -> None:
        self.scheduler, self.curve = scheduler, curve
        self.metrics = metrics
        self.limits = limits
        self.connections = connections
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self._offloads = asyncio.Semaphore(OFFLOAD_CONCURRENCY)  # large bodies parsed at once
        self._inflight: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._generate: AsyncGenerateClient | None = None
        self._control: AsyncGenerateClient | None = None
        self._max_context_len: int | None = None
        self.pairing: Any = NoPairing()  # a PD node behind SMG: kvstack.serve.pairing

    async def open(self) -> None:
        # Generate replies can be silent for a whole prefill: a long timeout. info and
        # abort are quick, and /health must say 503 quickly. One client id for both: the
        # scheduler lets only the client that submitted a rid abort it.
        self._generate = AsyncGenerateClient(
            self.scheduler, timeout_s=self.request_timeout_s, curve=self.curve
        )
        self._control = AsyncGenerateClient(
            self.scheduler,
            timeout_s=self.control_timeout_s,
            curve=self.curve,
            client_id=self._generate.client_id,
        )

    async def close(self) -> None:
        await self.pairing.close()
        if self._background:
            await asyncio.wait(self._background, timeout=self.control_timeout_s)
        for client in (self._generate, self._control):
            if client is not None:
                await client.close()

    # -- bodies ---------------------------------------------------------------------------

    async def parsed(self, request: web.Request, parse: Callable[[Any], T]) -> T:
        """The body decoded as JSON and given to ``parse`` (validation: :class:`ApiError`
        for a bad one): on the event loop for a small body, in a worker thread for a large
        one (``OFFLOAD_CONCURRENCY`` at a time), so that other requests keep being
        answered meanwhile."""
        body = await read_body(request, self.limits, self.connections)
        if len(body) <= INLINE_PARSE_BYTES:
            return parse(decode_json(body))
        async with self._offloads:
            return await asyncio.to_thread(lambda: parse(decode_json(body)))

    # -- one scheduler request ------------------------------------------------------------

    def rids(self, ones: Sequence[GenerateOne]) -> list[str]:
        """A rid for each request (its own, or a new one); 400 for one already running."""
        rids = [one.rid or uuid.uuid4().hex for one in ones]
        seen: set[str] = set()
        for rid in rids:
            if rid in self._inflight or rid in seen:
                raise ApiError(400, "duplicate_rid", f"request {rid!r} is already running")
            seen.add(rid)
        return rids

    def inflight(self) -> list[str]:
        """The rids of the requests in flight, sorted."""
        return sorted(self._inflight)

    async def events(self, one: GenerateOne, rid: str, *, stream: bool) -> AsyncIterator[Item]:
        """The scheduler's chunks and result for ``one``, its errors as :class:`ApiError`;
        SGLang's request metrics recorded. Closed before the result: the request is
        aborted (the client went away, or another request of its batch failed)."""
        assert self._generate is not None
        kwargs = {
            "text": one.text,
            "sampling": one.sampling_params.to_scheduler(),
            "rid": rid,
            "priority": one.priority,
            **_logprob_kwargs(one),
            **_cache_keys(one),
        }
        if rid in self._inflight:
            raise ApiError(400, "duplicate_rid", f"request {rid!r} is already running")
        kwargs.update(await self.pairing.kwargs(one, rid))
        started = last = time.monotonic()
        first = True
        settled = False  # finished, or refused by the scheduler: nothing to abort
        sglang = self.metrics.sglang
        self._inflight.add(rid)
        self.metrics.inflight.inc()
        try:
            async for item in self._generate.stream(one.input_ids, **kwargs):
                now = time.monotonic()
                if isinstance(item, GenerateResult):
                    settled = True
                    if one.log_metrics:
                        if first:
                            sglang.first_token(now - started, stream=stream)
                        sglang.finished(item.meta_info, now - started, stream=stream)
                elif one.log_metrics:
                    if first:
                        sglang.first_token(now - started, stream=stream)
                    else:
                        sglang.next_tokens(now - last, len(item.token_ids))
                first, last = False, now
                yield item
        except GenerateError as exc:
            settled = not isinstance(exc, PeerDeadError)
            raise ApiError(http_status(exc.status_code), exc.code, str(exc)) from None
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None
        finally:
            self._inflight.discard(rid)
            self.metrics.inflight.dec()
            self.metrics.generate_seconds.observe(time.monotonic() - started)
            if not settled:
                self._abort_later(rid)

    @staticmethod
    async def results(gens: Sequence[AsyncIterator[Item]]) -> list[GenerateResult]:
        """Each request's result; the first failure aborts the others and is raised."""

        async def result(gen: AsyncIterator[Item]) -> GenerateResult:
            async for item in gen:
                if isinstance(item, GenerateResult):
                    return item
            raise ApiError(503, "scheduler_unavailable", NO_RESULT)

        tasks = [asyncio.ensure_future(result(gen)) for gen in gens]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    async def firsts(gens: Sequence[AsyncIterator[Item]]) -> list[Item]:
        """The first item of each request (before the status line is sent, so that an
        intake rejection is a plain 4xx); a failure aborts the others and is raised."""

        async def first(gen: AsyncIterator[Item]) -> Item:
            item = await anext(gen, None)
            if item is None:
                raise ApiError(503, "scheduler_unavailable", NO_RESULT)
            return item

        tasks = [asyncio.ensure_future(first(gen)) for gen in gens]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    @staticmethod
    async def merged(
        gens: Sequence[AsyncIterator[Item]], firsts: Sequence[Item]
    ) -> AsyncIterator[tuple[int, Item]]:
        """``(index, item)`` of all requests as they come, each request's own in order."""
        pending: dict[asyncio.Future, int] = {}

        def follow(i: int) -> None:
            pending[asyncio.ensure_future(anext(gens[i]))] = i

        try:
            for i, item in enumerate(firsts):
                yield i, item
                if not isinstance(item, GenerateResult):
                    follow(i)
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        item = task.result()
                    except StopAsyncIteration:
                        raise ApiError(503, "scheduler_unavailable", NO_RESULT) from None
                    yield i, item
                    if not isinstance(item, GenerateResult):
                        follow(i)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- aborts ---------------------------------------------------------------------------

    async def abort(self, rids: Sequence[str]) -> list[str]:
        """Abort each of ``rids``; those the scheduler found."""
        assert self._control is not None
        found = []
        try:
            for rid in rids:
                if await self._control.abort(rid):
                    found.append(rid)
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None
        except GenerateError as exc:  # a rid another client of the scheduler submitted
            raise ApiError(exc.status_code, exc.code, str(exc)) from None
        return found

    def _abort_later(self, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_quietly(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, rid: str) -> None:
        assert self._control is not None
        try:
            await self._control.abort(rid)
        except PeerDeadError:
            log.warning("could not abort %s: the scheduler does not answer", rid)
        except GenerateError as exc:
            log.warning("could not abort %s: %s", rid, exc)

    # -- the scheduler's state ------------------------------------------------------------

    async def info(self) -> dict[str, Any]:
        """The scheduler's info reply; 503 when it does not answer or fails."""
        assert self._control is not None
        try:
            reply = await self._control.info()
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None
        if not reply.get("ok"):
            raise ApiError(503, reply.get("code", "internal"), reply.get("message", "info failed"))
        return {k: v for k, v in reply.items() if k not in ("ok", "op_id")}

    async def context_len(self) -> int:
        """The scheduler's ``max_context_len``, asked once."""
        if self._max_context_len is None:
            self._max_context_len = int((await self.info())["max_context_len"])
        return self._max_context_len

    async def flush_cache(self, **keys: str | None) -> tuple[bool, str]:
        """The scheduler's answer to emptying its prefix cache: flushed, and why not.
        ``keys`` (``cache_salt``, ``extra_key``), those set: only that namespace's."""
        assert self._control is not None
        flush = getattr(self._control, "flush_cache", None)
        if flush is None:
            raise ApiError(501, "not_implemented", "this scheduler cannot flush its cache")
        keys = {k: v for k, v in keys.items() if v is not None}
        try:
            return await flush(**keys)
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None


def _logprob_kwargs(one: GenerateOne) -> dict[str, Any]:
    kwargs = one.logprob_kwargs()
    if kwargs and "return_logprob" not in _stream_parameters():
        raise ApiError(
            400, "unsupported_field", "return_logprob: this scheduler does not return logprobs"
        )
    return kwargs


def _cache_keys(one: GenerateOne) -> dict[str, Any]:
    """The request's ``cache_salt`` / ``extra_key``, those set (the scheduler's namespace)."""
    return {name: getattr(one, name) for name in KEY_FIELDS if getattr(one, name) is not None}


def _stream_parameters() -> set[str]:
    return set(inspect.signature(AsyncGenerateClient.stream).parameters)
