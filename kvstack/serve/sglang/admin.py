"""SGLang's admin endpoints: health, model and server info, cache flush, aborts, metrics.

``/health`` asks the scheduler for its info, ``/health_generate`` generates
one token; ``/model_info`` and ``/server_info`` answer SGLang's keys (both
under their old ``/get_`` names too); ``/flush_cache`` and ``/abort_request``
act on the scheduler; ``/metrics`` is every service's exposition and the
front's, merged (:class:`~kvstack.serve.metrics.Scraper`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from kvstack.serve.cache_keys import KEY_FIELDS, split_keys
from kvstack.serve.errors import ApiError
from kvstack.serve.metrics import Scraper
from kvstack.serve.request_path import NO_RESULT, RequestPath
from kvstack.serve.sglang.protocol import AbortIn, GenerateOne, validate_body
from scheduler_svc.client import GenerateResult

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # SGLang's
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
# /model_info's disaggregation_mode, SGLang's values ("null", "prefill", "decode") by --mode.
# In PD mode the front stands where SGLang's PD router does, and that router answers
# /get_model_info with its first prefill server's: "prefill".
# A prefill or decode node behind SGLang's router says its role, as SGLang's do.
DISAGGREGATION_MODE = {"normal": "null", "pd": "prefill", "prefill": "prefill", "decode": "decode"}
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)  # SGLang's answer


@dataclass
class SGLangAdmin:
    """SGLang's admin endpoints over the shared request path."""

    path: RequestPath
    scraper: Scraper
    mode: str  # --mode: normal or pd
    checkpoint: Path | None
    model_path: str
    served_model_name: str
    incremental_streaming: bool

    async def health(self, request: web.Request) -> web.Response:
        await self.path.info()
        return web.json_response({"status": "ok"})

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's: generate one token; 200 once the scheduler answers, else 503."""
        one = GenerateOne(input_ids=[0], sampling_params={"max_new_tokens": 1}, log_metrics=False)
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        gen = self.path.events(one, rid, stream=False)

        async def generated() -> None:
            async for item in gen:
                if isinstance(item, GenerateResult):
                    return
            raise ApiError(503, "unhealthy", NO_RESULT)

        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                await asyncio.wait_for(generated(), HEALTH_CHECK_TIMEOUT_S)
        except (ApiError, TimeoutError) as exc:
            message = getattr(exc, "message", None) or "no answer from the scheduler"
            raise ApiError(503, "unhealthy", f"health check failed: {message}") from None
        return web.json_response({"status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/model_info`` keys."""
        config = _model_config(self.checkpoint)
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
        info = await self.path.info()
        info.setdefault("mode", self.mode)
        return web.json_response(
            {
                **info,
                "max_total_num_tokens": info.get("capacity"),  # SGLang's name for it
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "scheduler_address": self.path.scheduler,
                "incremental_streaming_output": self.incremental_streaming,
                "disaggregation_mode": DISAGGREGATION_MODE[self.mode],  # SMG's worker label
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

    async def version(self, request: web.Request) -> web.Response:
        """SGLang's ``/version`` (SMG asks it when it registers a worker)."""
        return web.json_response({"version": _version()})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's: the radix cache emptied if nothing runs or waits (200), else 400.

        kvstack's: with ``cache_salt`` and/or ``extra_key`` (query parameters, or a JSON
        object body), only that namespace's cached KV, in every tier, whatever runs.
        """
        keys = await self._flush_keys(request)
        ok, message = await self.path.flush_cache(**keys)
        if ok:
            return web.Response(text=FLUSHED)
        return web.Response(text=message or "Flush cache failed.\n", status=400)

    async def _flush_keys(self, request: web.Request) -> dict[str, str | None]:
        """``/flush_cache``'s cache keys: the query's, then a JSON body's (SGLang's own
        request has neither: both optional)."""
        fields: dict[str, Any] = {k: v for k, v in request.query.items() if k in KEY_FIELDS}
        if request.method == "POST" and request.can_read_body:
            body = await self.path.parsed(request, lambda data: data)
            if body is not None and not isinstance(body, dict):
                raise ApiError(400, "invalid_request", "the body must be a JSON object")
            unknown = sorted(set(body or {}) - set(KEY_FIELDS))
            if unknown:
                raise ApiError(400, "invalid_request", f"unknown field {unknown[0]!r}")
            fields.update(body or {})
        return split_keys(fields, None)[0]

    async def abort_request(self, request: web.Request) -> web.Response:
        body: AbortIn = await self.path.parsed(request, lambda data: validate_body(AbortIn, data))
        rids = self.path.inflight() if body.abort_all else [body.rid]
        found = await self.path.abort(rids)  # type: ignore[arg-type]
        if body.abort_all:
            return web.json_response({"aborted": found})
        return web.json_response({"rid": body.rid, "found": bool(found)})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=await self.scraper.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstack")
    except PackageNotFoundError:
        return "unknown"


def _model_config(checkpoint: Path | None) -> dict[str, Any]:
    """The checkpoint's config.json (model_type, architectures), or {} without one."""
    if checkpoint is None:
        return {}
    try:
        data = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
