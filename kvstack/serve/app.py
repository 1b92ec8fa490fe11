"""The aiohttp application of ``kvstack serve``: SGLang's endpoints over the generate API.

SGLang's native API (``/generate`` single and batch, ``/health``,
``/health_generate``, ``/model_info``, ``/server_info``, ``/flush_cache``,
``/abort_request``, ``/metrics``: :mod:`kvstack.serve.sglang`) and the
OpenAI-compatible one (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``: :mod:`kvstack.serve.openai`). Each family is given
the one :class:`~kvstack.serve.request_path.RequestPath`, which owns the
clients that reach the scheduler; :class:`HttpFront` builds them, routes to
them, and answers every error as JSON.

The front bounds what one client may cost (:mod:`kvstack.serve.limits`): a
body's size and the time it takes to arrive, the scheduler requests one body
becomes, and, through its :class:`~kvstack.serve.connections.ConnectionGuard`,
the connections held; a large body is decoded and validated in a worker
thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from kvstack.serve.connections import ConnectionGuard
from kvstack.serve.errors import ApiError, error_response, openai_error_body
from kvstack.serve.limits import FrontLimits
from kvstack.serve.metrics import FrontMetrics, Scraper
from kvstack.serve.openai.models import OpenAIServingModels
from kvstack.serve.openai.serving_chat import OpenAIServingChat
from kvstack.serve.openai.serving_completion import OpenAIServingCompletion
from kvstack.serve.pairing import BOOTSTRAP_PATH, DecodePairing, PrefillPairing
from kvstack.serve.request_path import RequestPath
from kvstack.serve.sglang.admin import SGLangAdmin
from kvstack.serve.sglang.generate import SGLangGenerate
from memsvc.curve import CurveClientKeys

log = logging.getLogger("kvstack.http")


@dataclass
class Backend:
    """What the front talks to: the generate API, where metrics are, whose tokenizer."""

    scheduler: str
    metrics: dict[str, str] = field(default_factory=dict)  # service name -> /metrics URL
    checkpoint: Path | None = None  # None: the byte tokenizer (the scheduler's default)
    pids: dict[str, int] = field(default_factory=dict)  # started services, by name
    curve: CurveClientKeys | None = None  # the scheduler's CURVE, if it has it on
    served_model_name: str | None = None  # the scheduler's, when it was asked
    transfer: str | None = None  # a decode node's memsvc --transfer-listen (behind SMG)


class HttpFront:
    """The aiohttp application: both endpoint families over one request path."""

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
        # SGLang's default served model name is the model path
        self.model_path = str(backend.checkpoint) if backend.checkpoint is not None else "tiny"
        self.served_model_name = served_model_name or self.model_path
        self.metrics = FrontMetrics(self.served_model_name, "unified")
        self.limits = limits or FrontLimits()
        self.connections = ConnectionGuard(self.limits.max_connections)
        self.path = RequestPath(
            backend.scheduler,
            curve=backend.curve,
            metrics=self.metrics,
            limits=self.limits,
            connections=self.connections,
            request_timeout_s=request_timeout_s,
            control_timeout_s=control_timeout_s,
        )
        self.scraper = Scraper(backend.metrics, self.metrics)
        self.pairing: PrefillPairing | None = None
        if mode == "prefill":
            self.path.pairing = self.pairing = PrefillPairing()
        elif mode == "decode":
            assert backend.transfer is not None, "a decode node needs its transfer socket"
            self.path.pairing = DecodePairing(backend.transfer)

    def app(self) -> web.Application:
        path, tokenizer, served = self.path, self.tokenizer, self.served_model_name
        generate = SGLangGenerate(path, tokenizer, incremental_streaming=self.incremental_streaming)
        admin = SGLangAdmin(
            path,
            self.scraper,
            mode=self.mode,
            checkpoint=self.backend.checkpoint,
            model_path=self.model_path,
            served_model_name=served,
            incremental_streaming=self.incremental_streaming,
        )
        completion = OpenAIServingCompletion(path, tokenizer)
        chat = OpenAIServingChat(path, tokenizer, served)
        models = OpenAIServingModels(path, served)
        app = web.Application(
            middlewares=[self._errors], client_max_size=self.limits.max_body_bytes
        )
        app.add_routes(
            [
                web.post("/generate", generate.generate),
                web.put("/generate", generate.generate),
                web.get("/health", admin.health),
                web.get("/health_generate", admin.health_generate),
                web.get("/get_model_info", admin.model_info),
                web.get("/model_info", admin.model_info),
                web.get("/get_server_info", admin.server_info),
                web.get("/server_info", admin.server_info),
                web.get("/version", admin.version),
                web.get("/flush_cache", admin.flush_cache),
                web.post("/flush_cache", admin.flush_cache),
                web.post("/abort_request", admin.abort_request),
                web.get("/metrics", admin.metrics),
                web.get("/v1/models", models.list_models),
                web.get("/v1/models/{model:.+}", models.retrieve_model),
                web.post("/v1/completions", completion.create_completion),
                web.post("/v1/chat/completions", chat.create_chat_completion),
            ]
        )
        if self.pairing is not None:  # the bootstrap port is this HTTP port (.pairing)
            app.add_routes([web.post(BOOTSTRAP_PATH, self.pairing.register)])
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        await self.path.open()
        await self.scraper.open()

    async def _close(self, app: web.Application) -> None:
        await self.path.close()
        await self.scraper.close()

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
