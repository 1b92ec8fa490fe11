"""``kvstack serve``: the stack behind SGLang's native HTTP API (aiohttp).

Either starts a stack itself (memsvc, model_svc, scheduler_svc, in a private
temporary folder, stopped and reaped on the way out) or, with ``--scheduler``,
fronts one that is already running (what docker compose does: one container
per process). Endpoints, as SGLang names them:

* ``POST /generate``: ``text`` or ``input_ids``, ``sampling_params``,
  ``stream`` (server-sent events, ``data: [DONE]`` last), ``rid``;
* ``GET /health``: 200 when the scheduler answers ``info``, else 503;
* ``GET /get_server_info``: the scheduler's ``info`` (pool size, page size,
  retraction policy, schedule conservativeness, mode);
* ``POST /abort_request``: ``{"rid": ...}`` (or ``{"abort_all": true}``);
* ``GET /metrics``: every service's Prometheus metrics and the front's own,
  merged into one exposition (one HELP/TYPE per family, a ``service`` label
  telling the sources apart), so that it parses.

Bad requests get a 4xx answer ``{"error": {"message", "code"}}`` at once:
the body is validated here (strictly, unknown fields refused) and the
scheduler's intake rejections (a prompt that can never fit, ids out of the
vocabulary...) keep the status code it gives them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from memsvc.cli import LOG_FORMAT, write_ready_file
from memsvc.client import PeerDeadError
from scheduler_svc.client import AsyncGenerateClient, Chunk, GenerateError, GenerateResult
from scheduler_svc.protocol import MAX_PROMPT_TOKENS, GenSampling

log = logging.getLogger("kvstack.http")

DEFAULT_PORT = 30000  # SGLang's
MAX_BODY_BYTES = 64 << 20  # a prompt of MAX_PROMPT_TOKENS ids, as JSON, fits
SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long, then are cancelled (and aborted)
SCRAPE_TIMEOUT_S = 3.0


class ServeError(RuntimeError):
    """The stack cannot be served as asked (exit status 2, the message on stderr)."""


# -- the stack behind the front ---------------------------------------------------------------


@dataclass
class Backend:
    """What the front talks to: the generate API, where metrics are, whose tokenizer."""

    scheduler: str
    metrics: dict[str, str] = field(default_factory=dict)  # service name -> /metrics URL
    checkpoint: Path | None = None  # None: the byte tokenizer (the scheduler's default)
    pids: dict[str, int] = field(default_factory=dict)  # started services, by name


def start_stack(launcher: Any, mode: str, args: argparse.Namespace) -> Backend:
    """Start the services of ``mode`` with ``launcher``; everything mode-specific lives here."""
    if mode == "normal":
        return _start_normal(launcher, args)
    if mode == "pd":
        return _start_pd(launcher, args)
    raise ServeError(f"unknown --mode {mode!r}")


def _start_pd(launcher: Any, args: argparse.Namespace) -> Backend:
    """Prefill node, decode node and router (``Launcher.start_pd_stack``); metrics of all four."""
    checkpoint = _checkpoint(args)
    pool = _flags(args, ["page_size", "num_pages", "max_running_requests", "max_context_len"])
    scheduler = _flags(
        args, ["schedule_conservativeness", "max_prefill_tokens", "chunked_prefill_size"]
    )
    scheduler += ["--checkpoint", str(checkpoint)]
    up = launcher.start_pd_stack(
        checkpoint,
        [*pool, "--metrics-port", "0"],
        [*scheduler, "--metrics-port", "0"],
        log_level=args.log_level,
    )
    metrics = {
        name: f"http://127.0.0.1:{up[name].metrics_port}/metrics"
        for name in ("memsvc-p", "memsvc-d", "scheduler-p", "scheduler-d")
    }
    return Backend(
        scheduler=up["router"].address,
        metrics=metrics,
        checkpoint=checkpoint,
        pids={s.name: s.proc.pid for s in up.values()},
    )


def _start_normal(launcher: Any, args: argparse.Namespace) -> Backend:
    checkpoint = _checkpoint(args)
    pool = _flags(
        args,
        ["page_size", "num_pages", "max_running_requests", "max_context_len"],
    )
    if args.disable_radix_cache:
        pool.append("--disable-radix-cache")
    scheduler = _flags(
        args, ["schedule_conservativeness", "max_prefill_tokens", "chunked_prefill_size"]
    )
    # The scheduler tokenizes `text` with the checkpoint's tokenizer, as the front decodes.
    scheduler += ["--checkpoint", str(checkpoint)]
    mem, model, sched = launcher.start_normal_stack(
        checkpoint,
        [*pool, "--metrics-port", "0"],
        [*scheduler, "--metrics-port", "0"],
        log_level=args.log_level,
    )
    return Backend(
        scheduler=sched.address,
        metrics={
            "memsvc": f"http://127.0.0.1:{mem.metrics_port}/metrics",
            "scheduler": f"http://127.0.0.1:{sched.metrics_port}/metrics",
        },
        checkpoint=checkpoint,
        pids={s.name: s.proc.pid for s in (mem, model, sched)},
    )


def _checkpoint(args: argparse.Namespace) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    from model_svc.tiny import default_checkpoint  # imports torch: only when needed

    return default_checkpoint()


def _flags(args: argparse.Namespace, names: Iterable[str]) -> list[str]:
    """``--name value`` for each option the user set (the services keep their own defaults)."""
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def _fronted(args: argparse.Namespace) -> Backend:
    metrics = {}
    for i, spec in enumerate(args.metrics_url):
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = f"source{i}", spec
        metrics[name] = url
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    return Backend(scheduler=args.scheduler, metrics=metrics, checkpoint=checkpoint)


def load_stream_tokenizer(checkpoint: Path | None) -> Any:
    """The tokenizer that turns streamed token ids into text (the scheduler's own choice)."""
    from model_svc.tokenizer import ByteTokenizer

    if checkpoint is None:
        return ByteTokenizer()
    from model_svc.config import ModelConfig
    from model_svc.errors import CheckpointError
    from model_svc.tokenizer import load_tokenizer

    try:
        return load_tokenizer(checkpoint, ModelConfig.from_file(checkpoint))
    except CheckpointError as exc:
        raise ServeError(f"--checkpoint: {exc}") from None


# -- request bodies ---------------------------------------------------------------------------


class SamplingParamsIn(GenSampling):
    """SGLang's ``sampling_params``: the scheduler's fields and bounds, types checked strictly.

    ``top_k`` also takes SGLang's -1 for "off" (the scheduler's 0).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    top_k: int = Field(default=0, ge=-1)

    def to_scheduler(self) -> dict[str, Any]:
        return {**self.model_dump(), "top_k": max(self.top_k, 0)}


class GenerateIn(BaseModel):
    """The body of ``POST /generate`` (one prompt; SGLang's batch form is not supported)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = Field(default=None, max_length=MAX_PROMPT_TOKENS)
    input_ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    priority: int | None = None
    # Sent as false by SGLang clients; true would need logprobs, which kvstack does not return.
    return_logprob: bool = False

    @model_validator(mode="after")
    def _check(self) -> GenerateIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.return_logprob:
            raise ValueError("return_logprob is not supported")
        return self


class AbortIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str | None = Field(default=None, min_length=1, max_length=256)
    abort_all: bool = False

    @model_validator(mode="after")
    def _check(self) -> AbortIn:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give rid or abort_all: true")
        return self


class ApiError(Exception):
    """Answered as ``{"error": {"message", "code"}}`` with HTTP status ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)


async def parse_body(request: web.Request, model: type[BaseModel]) -> Any:
    body = await request.read()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(400, "invalid_request", _validation_message(exc)) from None


def http_status(status_code: int) -> int:
    """The scheduler's status for a rejection, as an HTTP error status."""
    return status_code if 400 <= status_code <= 599 else 500


# -- streamed text ----------------------------------------------------------------------------


class StreamText:
    """The payload of each streamed chunk, SGLang style.

    By default every chunk carries the whole output so far (``text`` and
    ``output_ids``), as SGLang does; ``incremental`` (SGLang's
    ``--incremental-streaming-output``) sends only what is new, so the chunks
    concatenate to the output. Text never splits a character: a partial one
    waits for its next token.
    """

    def __init__(self, tokenizer: Any, *, incremental: bool) -> None:
        from model_svc.tokenizer import StreamDecoder

        self.incremental = incremental
        self._decoder = StreamDecoder(tokenizer)
        self._text = ""  # shown so far
        self._ids: list[int] = []
        self._sent_ids = 0

    def chunk(self, token_ids: Sequence[int]) -> dict[str, Any]:
        new_text = self._decoder.push(token_ids)
        self._text += new_text
        self._ids += token_ids
        return self._payload(new_text, self._ids)

    def done(self, result: GenerateResult) -> dict[str, Any]:
        full = result.text
        if full is None or not full.startswith(self._text):
            full = self._text + self._decoder.flush()
        new_text, self._text = full[len(self._text) :], full
        return self._payload(new_text, list(result.output_ids))

    def _payload(self, new_text: str, ids: list[int]) -> dict[str, Any]:
        if not self.incremental:
            return {"text": self._text, "output_ids": list(ids)}
        new_ids, self._sent_ids = ids[self._sent_ids :], len(ids)
        return {"text": new_text, "output_ids": new_ids}


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# -- metrics ----------------------------------------------------------------------------------


def parse_metrics(text: str) -> list[Any]:
    """The metric families of a Prometheus text exposition; ValueError if it is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def merge_metrics(sources: Sequence[tuple[str, list[Any]]]) -> bytes:
    """One exposition from several: ``(service, families)`` pairs (see :func:`parse_metrics`).

    Families of the same name from different sources (two memsvcs in PD mode)
    become one family with one HELP and one TYPE line, their samples told
    apart by a ``service`` label; a family whose type disagrees with the
    first source's is dropped (and logged) rather than making the whole
    exposition unparsable.
    """
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric

    families: dict[str, Metric] = {}
    for service, found in sources:
        for family in found:
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            elif merged.type != family.type:
                log.warning(
                    "metric %s is a %s in %s but a %s elsewhere; dropped from %s",
                    family.name,
                    family.type,
                    service,
                    merged.type,
                    service,
                )
                continue
            for sample in family.samples:
                labels = {"service": service, **sample.labels}
                merged.samples.append(sample._replace(labels=labels))

    class Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    return generate_latest(Merged())  # type: ignore[arg-type]


class FrontMetrics:
    """The front's own series: requests by endpoint and status, generate latency, in flight."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstack_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.generate_seconds = Histogram(
            "kvstack_http_generate_seconds",
            "Time from receiving a generate request to its last byte",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "kvstack_http_inflight_requests",
            "Generate requests in flight",
            registry=self.registry,
        )
        self.source_up = Gauge(
            "kvstack_http_metrics_source_up",
            "1 if the service's metrics answered the last scrape",
            ["source"],
            registry=self.registry,
        )

    def text(self) -> str:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry).decode()


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
        # timeout. info and abort are quick, and /health must say 503 quickly.
        self._generate = AsyncGenerateClient(
            self.backend.scheduler, timeout_s=self.request_timeout_s
        )
        self._control = AsyncGenerateClient(
            self.backend.scheduler, timeout_s=self.control_timeout_s
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


# -- the command ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve kvstack over SGLang's native HTTP API: start a stack (memsvc, model_svc, "
        "scheduler_svc) or front a running scheduler (--scheduler)."
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on")
    http.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (0: any free)")
    http.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="streamed chunks carry only the new text and ids (SGLang's flag); by default "
        "each chunk carries the whole output so far",
    )
    http.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a generate request may wait for the scheduler's next reply",
    )
    http.add_argument(
        "--control-timeout",
        type=float,
        default=5.0,
        help="seconds /health, /get_server_info and aborts wait for the scheduler",
    )
    http.add_argument(
        "--ready-file",
        default=None,
        help="write {address, pid, scheduler, services, metrics} as JSON here once serving",
    )
    http.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (also passed to the services started)",
    )

    stack = parser.add_argument_group("stack")
    stack.add_argument(
        "--mode",
        choices=["normal", "pd"],
        default="normal",
        help="normal: one node; pd: prefill/decode disaggregation",
    )
    stack.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="front the scheduler (or PD router) at this address instead of starting a stack",
    )
    stack.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="with --scheduler: a service's /metrics to include in ours (repeatable)",
    )
    stack.add_argument(
        "--checkpoint",
        default=None,
        help="model checkpoint folder (default: the bundled tiny model); with --scheduler, "
        "only its tokenizer is used, to decode streamed text",
    )

    pool = parser.add_argument_group("pool and scheduling (default: the services' own)")
    for flag, kind, help_text in [
        ("--page-size", int, "tokens per KV page"),
        ("--num-pages", int, "usable KV pages (capacity = num_pages x page_size)"),
        ("--max-running-requests", int, "requests holding KV at once"),
        ("--max-context-len", int, "longest request (prompt + output) in tokens"),
        ("--max-prefill-tokens", int, "most tokens one prefill batch computes"),
        ("--chunked-prefill-size", int, "split long prompts into chunks of this many tokens"),
        ("--schedule-conservativeness", float, "scales the initial new_token_ratio"),
    ]:
        pool.add_argument(flag, type=kind, default=None, help=help_text)
    pool.add_argument(
        "--disable-radix-cache", action="store_true", help="no prefix reuse between requests"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    signals = _DeferredSignals()
    signals.install()  # a signal while the stack starts stops it once it is up
    try:
        with contextlib.ExitStack() as exits:
            if args.scheduler:
                backend = _fronted(args)
            else:
                from scheduler_svc.launch import Launcher, LaunchError

                workdir = exits.enter_context(tempfile.TemporaryDirectory(prefix="kvstack-serve-"))
                launcher = Launcher(workdir)
                exits.callback(_report_leaks, launcher)  # runs once the launcher has stopped all
                exits.enter_context(launcher)
                try:
                    backend = start_stack(launcher, args.mode, args)
                except LaunchError as exc:
                    raise ServeError(str(exc)) from None
            if signals.received is not None:
                log.info("signal %d while starting: stopping", signals.received)
                return 0
            front = HttpFront(
                backend,
                mode=args.mode,
                tokenizer=load_stream_tokenizer(backend.checkpoint),
                incremental_streaming=args.incremental_streaming_output,
                request_timeout_s=args.request_timeout,
                control_timeout_s=args.control_timeout,
            )
            try:
                asyncio.run(serve(front, args, signals))
            finally:
                signals.install()  # the loop restored the defaults: stay alive to clean up
            return 0
    except ServeError as exc:
        print(f"kvstack serve: error: {exc}", file=sys.stderr)
        return 2


def _report_leaks(launcher: Any) -> None:
    """The launcher unlinks what a stopped service left in /dev/shm; say that it had to."""
    if launcher.leaked_segments:
        log.warning("services left shared memory behind (unlinked): %s", launcher.leaked_segments)


async def serve(
    front: HttpFront, args: argparse.Namespace, signals: _DeferredSignals | None = None
) -> None:
    """Serve until SIGINT / SIGTERM; in-flight requests get a short grace, then are aborted."""
    runner = web.AppRunner(
        front.app(), shutdown_timeout=SHUTDOWN_GRACE_S, handler_cancellation=True
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if signals is not None and signals.received is not None:
        stop.set()  # it came before the handlers above
    try:
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as exc:
            raise ServeError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
        host, port = runner.addresses[0][:2]
        address = f"http://{host}:{port}"
        write_ready_file(
            args.ready_file,
            address,
            scheduler=front.backend.scheduler,
            services=front.backend.pids,
            metrics=front.backend.metrics,
        )
        print(f"kvstack serve: listening on {address} (scheduler {front.backend.scheduler})")
        sys.stdout.flush()
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
        if args.ready_file:
            with contextlib.suppress(FileNotFoundError):
                Path(args.ready_file).unlink()


class _DeferredSignals:
    """SIGINT / SIGTERM noted instead of acted on, while the stack starts or stops.

    A signal that killed this process there would orphan the services it has
    started (or is starting, which the launcher does not yet know about).
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.received = signum
