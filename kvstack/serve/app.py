"""The aiohttp application of ``kvstack serve``: SGLang's endpoints over the generate API.

SGLang's native API (``/generate`` single and batch, ``/health``,
``/health_generate``, ``/model_info``, ``/server_info``, ``/flush_cache``,
``/abort_request``, ``/metrics``) and the OpenAI-compatible one
(``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``). Every
generation is one or more scheduler requests (a batch, ``n`` samples), each
streamed from the scheduler so that the front measures SGLang's time to first
token and inter-token latency also for requests answered whole.

``HttpFront`` owns the clients it uses to reach the scheduler (one for
generation, with a long timeout; one for info and aborts, with a short one)
and an HTTP session for scraping the services' metrics; all are opened and
closed with the application. It bounds what one client may cost
(:mod:`kvstack.serve.limits`): a body's size and the time it takes to arrive,
the scheduler requests one body becomes, and, through its
:class:`~kvstack.serve.connections.ConnectionGuard`, the connections held; a
large body is decoded and validated in a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from kvstack.serve.api import (
    SSE_DONE,
    AbortIn,
    ApiError,
    FrontMetrics,
    GenerateOne,
    Item,
    StreamMeta,
    decode_json,
    error_response,
    http_status,
    merge_metrics,
    openai_error_body,
    parse_generate,
    parse_metrics,
    sse,
    stream_text,
    validate_body,
    with_logprob_text,
)
from kvstack.serve.connections import ConnectionGuard
from kvstack.serve.limits import INLINE_PARSE_BYTES, OFFLOAD_CONCURRENCY, FrontLimits
from kvstack.serve.openai_routes import OpenAIRoutes
from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateError, GenerateResult

log = logging.getLogger("kvstack.http")
T = TypeVar("T")

SCRAPE_TIMEOUT_S = 3.0
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
# /model_info's disaggregation_mode, SGLang's values ("null", "prefill", "decode") by --mode.
# In PD mode the front stands where SGLang's PD router does, and that router answers
# /get_model_info with its first prefill server's: "prefill".
DISAGGREGATION_MODE = {"normal": "null", "pd": "prefill"}
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)  # SGLang's answer


@dataclass
class Backend:
    """What the front talks to: the generate API, where metrics are, whose tokenizer."""

    scheduler: str
    metrics: dict[str, str] = field(default_factory=dict)  # service name -> /metrics URL
    checkpoint: Path | None = None  # None: the byte tokenizer (the scheduler's default)
    pids: dict[str, int] = field(default_factory=dict)  # started services, by name
    curve: CurveClientKeys | None = None  # the scheduler's CURVE, if it has it on
    served_model_name: str | None = None  # the scheduler's, when it was asked


# -- the HTTP front ---------------------------------------------------------------------------


class HttpFront(OpenAIRoutes):
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
        served_model_name: str | None = None,
        limits: FrontLimits | None = None,
    ) -> None:
        self.backend = backend
        self.mode = mode
        self.tokenizer = tokenizer
        self.incremental_streaming = incremental_streaming
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        # SGLang's default served model name is the model path
        self.model_path = str(backend.checkpoint) if backend.checkpoint is not None else "tiny"
        self.served_model_name = served_model_name or self.model_path
        self.metrics = FrontMetrics(self.served_model_name, "unified")
        self.limits = limits or FrontLimits()
        self.connections = ConnectionGuard(self.limits.max_connections)
        self._offloads = asyncio.Semaphore(OFFLOAD_CONCURRENCY)  # large bodies parsed at once
        self._inflight: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._generate: AsyncGenerateClient | None = None
        self._control: AsyncGenerateClient | None = None
        self._http: ClientSession | None = None
        self._max_context_len: int | None = None

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors], client_max_size=self.limits.max_body_bytes
        )
        app.add_routes(
            [
                web.post("/generate", self.generate),
                web.put("/generate", self.generate),
                web.get("/health", self.health),
                web.get("/health_generate", self.health_generate),
                web.get("/get_model_info", self.model_info),
                web.get("/model_info", self.model_info),
                web.get("/get_server_info", self.server_info),
                web.get("/server_info", self.server_info),
                web.get("/flush_cache", self.flush_cache),
                web.post("/flush_cache", self.flush_cache),
                web.post("/abort_request", self.abort_request),
                web.get("/metrics", self.metrics_endpoint),
                web.get("/v1/models", self.list_models),
                web.get("/v1/models/{model:.+}", self.retrieve_model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # Generate replies can be silent for a whole prefill: a long timeout. info and
        # abort are quick, and /health must say 503 quickly. One client id for both: the
        # scheduler lets only the client that submitted a rid abort it.
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
        """Every error as JSON (OpenAI's error object under /v1/), every answer counted."""
        status = 500
        openai = request.path.startswith("/v1/")
        self.connections.busy(request.transport)
        try:
            response = await handler(request)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away (nginx's code for it)
            raise
        except ApiError as exc:
            status = exc.status
            if openai:
                body = openai_error_body(exc.status, exc.message, exc.param)
                return web.json_response(body, status=exc.status)
            return error_response(exc.status, exc.code, exc.message)
        except web.HTTPException as exc:  # aiohttp's own: 404, 405, 413...
            status = exc.status
            if openai:
                body = openai_error_body(exc.status, exc.text or exc.reason)
                return web.json_response(body, status=exc.status)
            code = exc.reason.lower().replace(" ", "_")
            return error_response(exc.status, code, exc.text or exc.reason)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            message = f"{type(exc).__name__}: {exc}"
            if openai:
                body = openai_error_body(500, f"Internal server error: {message}")
                return web.json_response(body, status=500)
            return error_response(500, "internal", message)
        finally:
            self.connections.waiting(request.transport)
            route = request.match_info.route.resource
            endpoint = route.canonical if route is not None else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()

    # -- request bodies -------------------------------------------------------------------

    async def _read_body(self, request: web.Request) -> bytes:
        """The body: 413 past ``--max-request-body-bytes`` (by its Content-Length, before
        reading it), 408 if it does not arrive within ``--http-body-timeout``."""
        limits = self.limits
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            raise _too_large(request.content_length, limits.max_body_bytes)
        try:
            with self.connections.receiving(request.transport):
                return await asyncio.wait_for(request.read(), limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(
                408,
                "body_timeout",
                f"the body did not arrive within {limits.body_timeout_s:g} s (--http-body-timeout)",
            ) from None
        except web.HTTPRequestEntityTooLarge:  # a chunked body, past the cap as it came
            raise _too_large(None, limits.max_body_bytes) from None

    async def _parsed(self, request: web.Request, parse: Callable[[Any], T]) -> T:
        """The body decoded as JSON and given to ``parse`` (validation: :class:`ApiError`
        for a bad one): on the event loop for a small body, in a worker thread for a large
        one (``OFFLOAD_CONCURRENCY`` at a time), so that other requests keep being
        answered meanwhile."""
        body = await self._read_body(request)
        if len(body) <= INLINE_PARSE_BYTES:
            return parse(decode_json(body))
        async with self._offloads:
            return await asyncio.to_thread(lambda: parse(decode_json(body)))

    # -- one scheduler request ------------------------------------------------------------

    def _rids(self, ones: Sequence[GenerateOne]) -> list[str]:
        rids = [one.rid or uuid.uuid4().hex for one in ones]
        seen: set[str] = set()
        for rid in rids:
            if rid in self._inflight or rid in seen:
                raise ApiError(400, "duplicate_rid", f"request {rid!r} is already running")
            seen.add(rid)
        return rids

    async def _events(self, one: GenerateOne, rid: str, *, stream: bool) -> AsyncIterator[Item]:
        """The scheduler's chunks and result for ``one``, its errors as :class:`ApiError`;
        SGLang's request metrics recorded. Closed before the result: the request is
        aborted (the client went away, or another request of its batch failed)."""
        assert self._generate is not None
        kwargs = {
            "text": one.text,
            "sampling": one.sampling_params.to_scheduler(),
            "rid": rid,
            "priority": one.priority,
            **self._logprob_kwargs(one),
        }
        if rid in self._inflight:
            raise ApiError(400, "duplicate_rid", f"request {rid!r} is already running")
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

    def _logprob_kwargs(self, one: GenerateOne) -> dict[str, Any]:
        kwargs = one.logprob_kwargs()
        if kwargs and "return_logprob" not in _stream_parameters():
            raise ApiError(
                400, "unsupported_field", "return_logprob: this scheduler does not return logprobs"
            )
        return kwargs

    async def _results(self, gens: Sequence[AsyncIterator[Item]]) -> list[GenerateResult]:
        """Each request's result; the first failure aborts the others and is raised."""

        async def result(gen: AsyncIterator[Item]) -> GenerateResult:
            async for item in gen:
                if isinstance(item, GenerateResult):
                    return item
            raise ApiError(503, "scheduler_unavailable", "the scheduler ended without a result")

        tasks = [asyncio.ensure_future(result(gen)) for gen in gens]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _firsts(self, gens: Sequence[AsyncIterator[Item]]) -> list[Item]:
        """The first item of each request (before the status line is sent, so that an
        intake rejection is a plain 4xx); a failure aborts the others and is raised."""

        async def first(gen: AsyncIterator[Item]) -> Item:
            item = await anext(gen, None)
            if item is None:
                raise ApiError(503, "scheduler_unavailable", "the scheduler ended without a result")
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
    async def _merged(
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
                        raise ApiError(
                            503, "scheduler_unavailable", "the scheduler ended without a result"
                        ) from None
                    yield i, item
                    if not isinstance(item, GenerateResult):
                        follow(i)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    # -- /generate ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        cap = self.limits.max_batch_requests
        parsed = await self._parsed(request, lambda data: parse_generate(data, cap))
        rids = self._rids(parsed.items)
        started = time.monotonic()
        gens = [
            self._events(one, rid, stream=parsed.stream)
            for one, rid in zip(parsed.items, rids, strict=True)
        ]
        async with contextlib.AsyncExitStack() as closing:
            for gen in gens:
                closing.push_async_callback(gen.aclose)  # type: ignore[attr-defined]
            if parsed.stream:
                return await self._native_stream(
                    request, parsed.items, rids, gens, parsed.batch, started
                )
            results = await self._results(gens)
            outs = [
                {
                    "text": result.text,
                    "output_ids": result.output_ids,
                    "meta_info": self._native_meta(one, rid, result.meta_info, started),
                }
                for one, rid, result in zip(parsed.items, rids, results, strict=True)
            ]
            return web.json_response(outs if parsed.batch else outs[0])

    def _native_meta(
        self, one: GenerateOne, rid: str, meta_info: dict[str, Any], started: float
    ) -> dict[str, Any]:
        # The scheduler's meta_info, with SGLang's id, and the latency the client sees.
        meta = {**meta_info, "id": rid, "e2e_latency": time.monotonic() - started}
        return with_logprob_text(meta, self.tokenizer) if one.return_text_in_logprobs else meta

    async def _native_stream(
        self,
        request: web.Request,
        ones: Sequence[GenerateOne],
        rids: Sequence[str],
        gens: Sequence[AsyncIterator[Item]],
        batch: bool,
        started: float,
    ) -> web.StreamResponse:
        firsts = await self._firsts(gens)
        response = await self._open_stream(request)
        incremental = self.incremental_streaming
        texts = [stream_text(self.tokenizer, one, incremental=incremental) for one in ones]
        metas = [StreamMeta(rid, incremental=incremental) for rid in rids]
        try:
            async with contextlib.aclosing(self._merged(gens, firsts)) as merged:
                async for i, item in merged:
                    if isinstance(item, Chunk):
                        payload = texts[i].chunk(item.token_ids)
                        meta = metas[i].chunk(
                            getattr(item, "meta_info", None), item.offset + len(item.token_ids)
                        )
                    else:
                        payload = texts[i].done(item)
                        meta = metas[i].done(item.meta_info)
                        meta["e2e_latency"] = time.monotonic() - started
                    if ones[i].return_text_in_logprobs:
                        meta = with_logprob_text(meta, self.tokenizer)
                    payload["meta_info"] = meta
                    if batch:
                        payload["index"] = i
                    await response.write(sse(payload))
        except ApiError as exc:  # the status line is sent: report in the stream
            await response.write(sse({"error": {"message": exc.message, "code": exc.code}}))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

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

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's: generate one token; 200 once the scheduler answers, else 503."""
        one = GenerateOne(input_ids=[0], sampling_params={"max_new_tokens": 1}, log_metrics=False)
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        gen = self._events(one, rid, stream=False)

        async def generated() -> None:
            async for item in gen:
                if isinstance(item, GenerateResult):
                    return
            raise ApiError(503, "unhealthy", "the scheduler ended without a result")

        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                await asyncio.wait_for(generated(), HEALTH_CHECK_TIMEOUT_S)
        except (ApiError, TimeoutError) as exc:
            message = getattr(exc, "message", None) or "no answer from the scheduler"
            raise ApiError(503, "unhealthy", f"health check failed: {message}") from None
        return web.json_response({"status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/model_info`` keys."""
        config = _model_config(self.backend.checkpoint)
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": DISAGGREGATION_MODE[self.mode],
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": config.get("model_type"),
                "architectures": config.get("architectures"),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = await self._info()
        info.setdefault("mode", self.mode)
        return web.json_response(
            {
                **info,
                "max_total_num_tokens": info.get("capacity"),  # SGLang's name for it
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "scheduler_address": self.backend.scheduler,
                "incremental_streaming_output": self.incremental_streaming,
                "internal_states": [
                    {
                        k: info[k]
                        for k in ("new_token_ratio", "num_running", "num_waiting")
                        if k in info
                    }
                ],
                "version": _version(),
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's: the radix cache emptied if nothing runs or waits (200), else 400."""
        assert self._control is not None
        flush = getattr(self._control, "flush_cache", None)
        if flush is None:
            raise ApiError(501, "not_implemented", "this scheduler cannot flush its cache")
        try:
            ok, message = await flush()
        except PeerDeadError as exc:
            raise ApiError(503, "scheduler_unavailable", str(exc)) from None
        if ok:
            return web.Response(text=FLUSHED)
        return web.Response(text=message or "Flush cache failed.\n", status=400)

    async def abort_request(self, request: web.Request) -> web.Response:
        body: AbortIn = await self._parsed(request, lambda data: validate_body(AbortIn, data))
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


def _too_large(size: int | None, cap: int) -> ApiError:
    got = f"{size} bytes" if size is not None else "more"
    return ApiError(
        413,
        "body_too_large",
        f"the body is {got}; this server takes at most {cap} bytes (--max-request-body-bytes)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstack")
    except PackageNotFoundError:
        return "unknown"


def _stream_parameters() -> set[str]:
    return set(inspect.signature(AsyncGenerateClient.stream).parameters)


def _model_config(checkpoint: Path | None) -> dict[str, Any]:
    """The checkpoint's config.json (model_type, architectures), or {} without one."""
    import json

    if checkpoint is None:
        return {}
    try:
        data = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
