"""The aiohttp application of ``kvstack serve``: SGLang's endpoints over the generate API.

``HttpFront`` owns the clients it uses to reach the scheduler (one for
generation, with a long timeout; one for info and aborts, with a short one)
and an HTTP session for scraping the services' metrics; all are opened and
closed with the application.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from kvstack.serve.api import (
    SSE_DONE,
    AbortIn,
    ApiError,
    FrontMetrics,
    GenerateIn,
    StreamText,
    error_response,
    http_status,
    merge_metrics,
    parse_body,
    parse_metrics,
    sse,
)
from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateError, GenerateResult

log = logging.getLogger("kvstack.http")

MAX_BODY_BYTES = 64 << 20  # a prompt of MAX_PROMPT_TOKENS ids, as JSON, fits
SCRAPE_TIMEOUT_S = 3.0


@dataclass
class Backend:
    """What the front talks to: the generate API, where metrics are, whose tokenizer."""

    scheduler: str
    metrics: dict[str, str] = field(default_factory=dict)  # service name -> /metrics URL
    checkpoint: Path | None = None  # None: the byte tokenizer (the scheduler's default)
    pids: dict[str, int] = field(default_factory=dict)  # started services, by name
    curve: CurveClientKeys | None = None  # the scheduler's CURVE, if it has it on


# -- the HTTP front ---------------------------------------------------------------------------


class HttpFront:
    """The aiohttp application and the clients it uses to reach the scheduler."""

    def __init__(
        self,
        backend: Backend,
        *,
        mode: str,
        tokenizer: Any,
        incremental_streaming: bool = False,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 5.0,
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.tokenizer = tokenizer
        self.incremental_streaming = incremental_streaming
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.metrics = FrontMetrics()
        self._inflight: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._generate: AsyncGenerateClient | None = None
        self._control: AsyncGenerateClient | None = None
        self._http: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=MAX_BODY_BYTES)
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.get("/health", self.health),
                web.get("/get_server_info", self.server_info),
                web.post("/abort_request", self.abort_request),
                web.get("/metrics", self.metrics_endpoint),
            ]
        )
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # Generate replies can be silent for a whole generation (non-streaming): a long
        # timeout. info and abort are quick, and /health must say 503 quickly. One client
        # id for both: the scheduler lets only the client that submitted a rid abort it.
        self._generate = AsyncGenerateClient(
            self.backend.scheduler, timeout_s=self.request_timeout_s, curve=self.backend.curve
        )
        self._control = AsyncGenerateClient(
            self.backend.scheduler,
            timeout_s=self.control_timeout_s,
            curve=self.backend.curve,
            client_id=self._generate.client_id,
        )
        self._http = ClientSession(timeout=ClientTimeout(total=SCRAPE_TIMEOUT_S))

    async def _close(self, app: web.Application) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=self.control_timeout_s)
        for client in (self._generate, self._control):
            if client is not None:
                await client.close()
        if self._http is not None:
            await self._http.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error as ``{"error": ...}`` JSON, and every answer counted."""
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away (nginx's code for it)
            raise
        except ApiError as exc:
            status = exc.status
            return error_response(exc.status, exc.code, exc.message)
        except web.HTTPException as exc:  # aiohttp's own: 404, 405, 413...
            status = exc.status
            code = exc.reason.lower().replace(" ", "_")
            return error_response(exc.status, code, exc.text or exc.reason)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            route = request.match_info.route.resource
            endpoint = route.canonical if route is not None else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()

    # -- /generate ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body: GenerateIn = await parse_body(request, GenerateIn)
        rid = body.rid or uuid.uuid4().hex
        if rid in self._inflight:
            raise ApiError(400, "duplicate_rid", f"request {rid!r} is already running")
        started = time.monotonic()
        self._inflight.add(rid)
        self.metrics.inflight.inc()
        try:
            items = self._generate_items(body, rid)
            try:
                if body.stream:
                    return await self._stream(request, rid, items, started)
                return await self._whole(rid, items, started)
            finally:
                await items.aclose()
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: stop generating for nobody.
            self._abort_later(rid)
            raise
        finally:
            self._inflight.discard(rid)
            self.metrics.inflight.dec()
            self.metrics.generate_seconds.observe(time.monotonic() - started)

    async def _generate_items(
        self, body: GenerateIn, rid: str
    ) -> AsyncIterator[Chunk | GenerateResult]:
        """The scheduler's chunks (when streaming) and result, its errors as :class:`ApiError`."""
        assert self._generate is not None
        kwargs = {
            "text": body.text,
            "sampling": body.sampling_params.to_scheduler(),
            "rid": rid,
            "priority": body.priority,
        }
        try:
            if body.stream:
                async for item in self._generate.stream(body.input_ids, **kwargs):
                    yield item
            else:
                yield await self._generate.generate(body.input_ids, **kwargs)
        except GenerateError as exc:
            raise ApiError(http_status(exc.status_code), exc.code, str(exc)) from None
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None

    async def _whole(
        self, rid: str, items: AsyncIterator[Chunk | GenerateResult], started: float
    ) -> web.Response:
        async for item in items:
            if isinstance(item, GenerateResult):
                return web.json_response(
                    {
                        "text": item.text,
                        "output_ids": item.output_ids,
                        "meta_info": self._meta(rid, item, started),
                    }
                )
        raise ApiError(503, "scheduler_unavailable", "the scheduler ended without a result")

    async def _stream(
        self,
        request: web.Request,
        rid: str,
        items: AsyncIterator[Chunk | GenerateResult],
        started: float,
    ) -> web.StreamResponse:
        # Wait for the first item before answering, so an intake rejection is a plain 4xx.
        first = await anext(items, None)
        if first is None:
            raise ApiError(503, "scheduler_unavailable", "the scheduler ended without a result")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        text = StreamText(self.tokenizer, incremental=self.incremental_streaming)
        item: Chunk | GenerateResult | None = first
        try:
            while item is not None:
                if isinstance(item, Chunk):
                    payload = text.chunk(item.token_ids)
                    payload["meta_info"] = {
                        "id": rid,
                        "finish_reason": None,
                        "completion_tokens": item.offset + len(item.token_ids),
                    }
                else:
                    payload = text.done(item)
                    payload["meta_info"] = self._meta(rid, item, started)
                await response.write(sse(payload))
                item = None if isinstance(item, GenerateResult) else await anext(items, None)
        except ApiError as exc:  # the status line is sent: report in the stream
            await response.write(sse({"error": {"message": exc.message, "code": exc.code}}))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    @staticmethod
    def _meta(rid: str, result: GenerateResult, started: float) -> dict[str, Any]:
        # The scheduler's meta_info, with SGLang's id, and the latency the client sees.
        return {**result.meta_info, "id": rid, "e2e_latency": time.monotonic() - started}

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

    # -- the rest -------------------------------------------------------------------------

    async def _info(self) -> dict[str, Any]:
        assert self._control is not None
        try:
            reply = await self._control.info()
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None
        if not reply.get("ok"):
            raise ApiError(503, reply.get("code", "internal"), reply.get("message", "info failed"))
        return {k: v for k, v in reply.items() if k not in ("ok", "op_id")}

    async def health(self, request: web.Request) -> web.Response:
        await self._info()
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        info = await self._info()
        info.setdefault("mode", self.mode)
        return web.json_response(
            {
                **info,
                "max_total_num_tokens": info.get("capacity"),  # SGLang's name for it
                "scheduler_address": self.backend.scheduler,
                "incremental_streaming_output": self.incremental_streaming,
                "version": _version(),
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body: AbortIn = await parse_body(request, AbortIn)
        assert self._control is not None
        rids = sorted(self._inflight) if body.abort_all else [body.rid]
        found = []
        try:
            for rid in rids:
                if await self._control.abort(rid):
                    found.append(rid)
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None
        except GenerateError as exc:  # a rid another client of the scheduler submitted
            raise ApiError(exc.status_code, exc.code, str(exc)) from None
        if body.abort_all:
            return web.json_response({"aborted": found})
        return web.json_response({"rid": body.rid, "found": bool(found)})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        names = list(self.backend.metrics)
        texts = await asyncio.gather(*(self._scrape(self.backend.metrics[n]) for n in names))
        sources = []
        for name, text in zip(names, texts, strict=True):
            found = None
            if text is not None:
                try:
                    found = parse_metrics(text)
                except ValueError as exc:
                    log.warning("metrics of %s are not the text format: %s", name, exc)
            self.metrics.source_up.labels(name).set(0 if found is None else 1)
            if found is not None:
                sources.append((name, found))
        sources.append(("http", parse_metrics(self.metrics.text())))
        return web.Response(
            body=merge_metrics(sources), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def _scrape(self, url: str) -> str | None:
        assert self._http is not None
        try:
            async with self._http.get(url) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (ClientError, OSError, asyncio.TimeoutError) as exc:
            log.debug("scraping %s failed: %s", url, exc)
            return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstack")
    except PackageNotFoundError:
        return "unknown"
