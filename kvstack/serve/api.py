"""The HTTP wire of ``kvstack serve``: request bodies, error replies, SSE, merged metrics.

Plain functions and pydantic models with no I/O, so they are tested without
a server: bodies are validated strictly (unknown fields refused) into
SGLang's shapes; errors become ``{"error": {"message", "code"}}``; streamed
token ids become SSE events; several Prometheus expositions become one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler_svc.client import GenerateResult
from scheduler_svc.protocol import MAX_PROMPT_TOKENS, GenSampling, Int64

log = logging.getLogger("kvstack.http")


# -- request bodies ---------------------------------------------------------------------------


class SamplingParamsIn(GenSampling):
    """SGLang's ``sampling_params``: the scheduler's fields and bounds, types checked strictly.

    ``top_k`` also takes SGLang's -1 for "off" (the scheduler's 0).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    top_k: int = Field(default=0, ge=-1, lt=2**63)

    def to_scheduler(self) -> dict[str, Any]:
        return {**self.model_dump(), "top_k": max(self.top_k, 0)}


class GenerateIn(BaseModel):
    """The body of ``POST /generate`` (one prompt; SGLang's batch form is not supported)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = Field(default=None, max_length=MAX_PROMPT_TOKENS)
    input_ids: list[Int64] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    priority: Int64 | None = None
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
    except RecursionError:
        raise ApiError(400, "malformed_json", "the body nests too deeply to parse") from None
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
