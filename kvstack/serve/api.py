"""The HTTP wire of ``kvstack serve``: request bodies, error replies, SSE, merged metrics.

Plain functions and pydantic models with no I/O, so they are tested without
a server: ``/generate`` bodies (SGLang's single and batch forms) are validated
strictly into the requests to send (SGLang's fields kvstack does not honour
accepted only at their defaults, :mod:`.sglang_fields`; unknown fields
refused); errors become ``{"error": {"message", "code"}}`` (OpenAI's error
object under ``/v1/``); streamed token ids become SSE events with SGLang's
``meta_info``; several Prometheus expositions become one; the front's own
metrics include SGLang's request metrics under SGLang's names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstack.serve.limits import DEFAULT_MAX_BATCH_REQUESTS
from kvstack.serve.sglang_fields import (
    ABORT_DEFAULTS,
    GENERATE_DEFAULTS,
    Unsupported,
    check_default_only,
    find_non_finite,
    pop_n,
    sampling_to_kvstack,
)
from scheduler_svc import protocol as _protocol
from scheduler_svc.client import Chunk, GenerateResult
from scheduler_svc.protocol import EMPTY_PROMPT, MAX_PROMPT_TOKENS, GenSampling, Int64

log = logging.getLogger("kvstack.http")


# -- request bodies ---------------------------------------------------------------------------


class SamplingParamsIn(GenSampling):
    """SGLang's ``sampling_params``: the scheduler's fields and bounds, types checked strictly.

    SGLang's spellings are translated first (:func:`.sglang_fields.sampling_to_kvstack`:
    ``top_k`` -1 is the scheduler's 0, "off"; ``sampling_seed``; ``stop`` as one string;
    null for the default), and SGLang's fields kvstack does not honour must be at their
    defaults.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _from_sglang(cls, data: Any) -> Any:
        return sampling_to_kvstack(data)

    def to_scheduler(self) -> dict[str, Any]:
        return self.model_dump()


MAX_TOP_LOGPROBS = getattr(_protocol, "MAX_TOP_LOGPROBS", 20)


class GenerateOne(BaseModel):
    """One prompt of ``POST /generate`` (a batch is split into these: :func:`parse_generate`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = Field(default=None, max_length=MAX_PROMPT_TOKENS)
    # fail_fast: one error for a bad list, not one per id (a million of them, at 400 bytes)
    input_ids: list[Int64] | None = Field(
        default=None, max_length=MAX_PROMPT_TOKENS, fail_fast=True
    )
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    priority: Int64 | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(default=-1, ge=-1, lt=2**63)
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    no_logs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        # SGLang reads null as "unset" for all of these
        if isinstance(data, dict):
            check_prompt_len(data.get("input_ids"))
            nullable = ("return_logprob", "logprob_start_len", "top_logprobs_num")
            return {k: v for k, v in data.items() if not (v is None and k in nullable)}
        return data

    @model_validator(mode="after")
    def _check(self) -> GenerateOne:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    def check_prompt(self) -> GenerateOne:
        """Itself, or SGLang's 400 for a prompt with nothing to prefill (no text, no ids:
        the scheduler refuses one that tokenizes to nothing, for a bos would not count)."""
        if not (self.text or self.input_ids):
            raise ApiError(400, "invalid_request", EMPTY_PROMPT)
        return self

    def logprob_kwargs(self) -> dict[str, Any]:
        if not self.return_logprob:
            return {}
        return {
            "return_logprob": True,
            "logprob_start_len": self.logprob_start_len,
            "top_logprobs_num": self.top_logprobs_num,
        }


def check_prompt_len(input_ids: Any, name: str = "input_ids") -> None:
    """ValueError for a list of more than ``MAX_PROMPT_TOKENS`` ids, before its ids are
    validated one by one (the body cap lets through millions)."""
    if isinstance(input_ids, list) and len(input_ids) > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"{name}: at most {MAX_PROMPT_TOKENS} tokens in a prompt, got {len(input_ids)}"
        )


@dataclass
class GenerateBatch:
    """A ``/generate`` body as the requests to send: ``items`` in SGLang's order (prompt by
    prompt, each prompt's ``n`` samples together); ``batch``: answer with a list."""

    items: list[GenerateOne]
    batch: bool
    stream: bool


# GenerateReqInput fields that hold one value per prompt in a batch (a list), or one
# value for all of them.
_PER_PROMPT = (
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "priority",
)


def parse_generate(data: Any, max_requests: int = DEFAULT_MAX_BATCH_REQUESTS) -> GenerateBatch:
    """A ``/generate`` body, SGLang's single or batch form, as :class:`GenerateBatch`.

    Raises :class:`ApiError` (400): a field not honoured at a non-default value
    (``unsupported_field``), more than ``max_requests`` prompts × ``n``
    (``batch_too_large``, the prompt list checked before its items), anything
    else invalid (``invalid_request``).
    """
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "the body must be a JSON object")
    try:
        fields = check_default_only(data, GENERATE_DEFAULTS)
    except Unsupported as exc:
        raise ApiError(400, "unsupported_field", str(exc), param=exc.field) from None
    size = _batch_size(fields)
    check_batch(size or 1, 1, max_requests)
    prompts = []
    for i in range(size or 1):
        item = dict(fields)
        if size is not None:
            for key in ("text", "input_ids"):
                if isinstance(item.get(key), list):
                    item[key] = item[key][i]
            for key in _PER_PROMPT:
                value = fields.get(key)
                if isinstance(value, list):
                    if len(value) != size:
                        raise ApiError(
                            400,
                            "invalid_request",
                            f"{key}: {len(value)} values for a batch of {size} prompts",
                        )
                    item[key] = value[i]
                elif key == "rid" and value is not None:
                    raise ApiError(400, "invalid_request", "rid: a batch needs a list of rids")
        prompts.append(item)
    items = []
    for i, item in enumerate(prompts):
        where = f"[{i}]." if size is not None else ""
        try:
            item["sampling_params"], n = pop_n(
                item.get("sampling_params") or {}, f"{where}sampling_params.n"
            )
            one = GenerateOne.model_validate(item)
        except Unsupported as exc:
            raise ApiError(400, "unsupported_field", f"{where}{exc}", param=exc.field) from None
        except ValidationError as exc:
            raise ApiError(400, "invalid_request", _validation_message(exc, where)) from None
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        check_batch(size or 1, n, max_requests)
        items += parallel_samples(one.check_prompt(), n)
    batch = size is not None or len(items) > 1
    return GenerateBatch(items, batch, bool(fields.get("stream", False)))


def _batch_size(fields: dict[str, Any]) -> int | None:
    """How many prompts a batch body holds; None for a single prompt."""
    text, ids = fields.get("text"), fields.get("input_ids")
    if text is not None and ids is not None:  # before splitting lists of unequal lengths
        raise ApiError(400, "invalid_request", "give exactly one of text and input_ids")
    size = None
    if isinstance(text, list):
        size = len(text)
    elif isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        size = len(ids)
    if size == 0:
        raise ApiError(400, "invalid_request", "a batch needs at least one prompt")
    return size


def parallel_samples(one: Any, n: int) -> list[Any]:
    """``n`` requests for SGLang's parallel sampling: sample j gets ``seed + j`` (so seeded
    samples differ, greedy ones are the same) and rid ``{rid}_{j}`` if a rid was given."""
    if n == 1:
        return [one]
    out = []
    sampling = one.sampling_params
    for j in range(n):
        update: dict[str, Any] = {}
        if "seed" in type(sampling).model_fields:
            seed = (sampling.seed + j) % (2**63)
            update["sampling_params"] = sampling.model_copy(update={"seed": seed})
        if one.rid is not None:
            update["rid"] = f"{one.rid}_{j}"
        out.append(one.model_copy(update=update))
    return out


class AbortIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str | None = Field(default=None, min_length=1, max_length=256)
    abort_all: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = check_default_only(data, ABORT_DEFAULTS)  # SGLang's AbortReq, the rest of it
        if data.get("rid") == "" and data.get("abort_all"):  # SGLang's rid with abort_all
            return {k: v for k, v in data.items() if k != "rid"}
        return data

    @model_validator(mode="after")
    def _check(self) -> AbortIn:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("give rid or abort_all: true")
        return self


class ApiError(Exception):
    """Answered as ``{"error": {"message", "code"}}`` with HTTP status ``status`` (under
    ``/v1/``, OpenAI's error object: :func:`openai_error_body`)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


OPENAI_ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object as SGLang's OpenAI server answers it."""
    return {
        "object": "error",
        "message": message,
        "type": OPENAI_ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "Error"),
        "param": param,
        "code": status,
    }


def _validation_message(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = prefix + ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)


def decode_json(body: bytes) -> Any:
    """The body as JSON; :class:`ApiError` 400 if it is not JSON, or holds NaN or an
    infinity (which Python's json accepts and JSON does not)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "malformed_json", "the body nests too deeply to parse") from None
    where = find_non_finite(data)
    if where is not None:
        raise ApiError(
            400,
            "invalid_request",
            f"{where}: NaN and Infinity are not valid JSON numbers",
            param=where,
        )
    return data


def validate_body(model: type[BaseModel], data: Any) -> Any:
    """``data`` as ``model``; :class:`ApiError` 400 naming what is wrong otherwise."""
    try:
        return model.model_validate(data)
    except Unsupported as exc:
        raise ApiError(400, "unsupported_field", str(exc), param=exc.field) from None
    except ValidationError as exc:
        raise ApiError(400, "invalid_request", _validation_message(exc)) from None


def check_batch(num_prompts: int, n: int, max_requests: int, param: str | None = None) -> None:
    """:class:`ApiError` 400 naming the cap if ``num_prompts`` prompts, each sampled ``n``
    times, would be more than ``max_requests`` scheduler requests."""
    if num_prompts * n <= max_requests:
        return
    shape = f"{num_prompts} prompts" + (f" × n {n}" if n > 1 else "")
    raise ApiError(
        400,
        "batch_too_large",
        f"{param + ': ' if param else ''}this request would be {num_prompts * n} scheduler "
        f"requests ({shape}); a request may be at most {max_requests} "
        "(--max-batch-requests)",
        param=param,
    )


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
    waits for its next token. With ``stop`` strings, text that could be the
    start of one waits too (the scheduler cuts a matched stop string from the
    output, and what was sent cannot be taken back).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        incremental: bool,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        from model_svc.tokenizer import StreamDecoder

        self.incremental = incremental
        if not skip_special_tokens:
            tokenizer = _ShowSpecials(tokenizer)
        self._decoder = StreamDecoder(tokenizer)
        self._stop = [s for s in stop if s]
        self._decoded = ""  # the decoder's text so far
        self._text = ""  # shown so far
        self._ids: list[int] = []
        self._sent_ids = 0

    def chunk(self, token_ids: Sequence[int]) -> dict[str, Any]:
        self._decoded += self._decoder.push(token_ids)
        shown = self._decoded[: len(self._decoded) - self._held_back()]
        new_text = shown[len(self._text) :] if shown.startswith(self._text) else ""
        self._text += new_text
        self._ids += token_ids
        return self._payload(new_text, self._ids)

    def _held_back(self) -> int:
        """How much of the end of the decoded text might be (the start of) a stop string."""
        text, hold = self._decoded, 0
        for stop in self._stop:
            at = text.find(stop, max(0, len(self._text) - len(stop) + 1))
            if at >= 0:
                hold = max(hold, len(text) - at)
                continue
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def done(self, result: GenerateResult) -> dict[str, Any]:
        full = result.text
        if full is None:
            full = self._decoded + self._decoder.flush()
        # "": the scheduler's text differs from what was shown (a trimmed stop token)
        new_text = full[len(self._text) :] if full.startswith(self._text) else ""
        self._text = full if not self.incremental else self._text + new_text
        return self._payload(new_text, list(result.output_ids))

    def _payload(self, new_text: str, ids: list[int]) -> dict[str, Any]:
        if not self.incremental:
            return {"text": self._text, "output_ids": list(ids)}
        new_ids, self._sent_ids = ids[self._sent_ids :], len(ids)
        return {"text": new_text, "output_ids": new_ids}


Item = Chunk | GenerateResult  # what a scheduler request yields: chunks, then its result


def stream_text(tokenizer: Any, one: Any, *, incremental: bool) -> StreamText:
    """The :class:`StreamText` of a parsed request (its stop strings, its special tokens)."""
    sampling = one.sampling_params
    return StreamText(
        tokenizer,
        incremental=incremental,
        stop=list(getattr(sampling, "stop", None) or []),
        skip_special_tokens=getattr(sampling, "skip_special_tokens", True),
    )


class _ShowSpecials:
    """A tokenizer whose ``decode`` keeps special tokens (``skip_special_tokens: false``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special=False)


LOGPROB_KEYS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
)


def with_logprob_text(meta_info: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """``meta_info`` with each ``[logprob, token_id, None]`` given its token's text
    (SGLang's ``return_text_in_logprobs``)."""

    def entry(item: Any) -> Any:
        if isinstance(item, list) and len(item) == 3 and isinstance(item[1], int):
            return [item[0], item[1], tokenizer.decode([item[1]], skip_special=False)]
        return item

    out = dict(meta_info)
    for key in LOGPROB_KEYS:
        value = out.get(key)
        if not isinstance(value, list):
            continue
        if key.endswith("top_logprobs"):
            out[key] = [[entry(e) for e in pos] if isinstance(pos, list) else pos for pos in value]
        else:
            out[key] = [entry(e) for e in value]
    return out


class StreamMeta:
    """The ``meta_info`` of each streamed chunk, SGLang style.

    Every chunk carries the scheduler's counts so far (``prompt_tokens``,
    ``cached_tokens``, ``completion_tokens``, ``num_retractions``); with
    logprobs, the chunk's new ones accumulate, so that by default each chunk
    holds all of them so far (as its ``text`` holds the whole output), and
    with ``incremental`` only those new in it.
    """

    def __init__(self, rid: str, *, incremental: bool) -> None:
        self.rid, self.incremental = rid, incremental
        self._lists: dict[str, list[Any]] = {}
        self._sent: dict[str, int] = {}

    def chunk(self, meta_info: dict[str, Any] | None, completion_tokens: int) -> dict[str, Any]:
        meta = dict(meta_info or {})
        for key in LOGPROB_KEYS:
            new = meta.pop(key, None)
            if isinstance(new, list):
                self._lists.setdefault(key, []).extend(new)
        meta.update({"id": self.rid, "finish_reason": None})
        meta.setdefault("completion_tokens", completion_tokens)
        meta.update(self._logprobs())
        return meta

    def done(self, meta_info: dict[str, Any]) -> dict[str, Any]:
        meta = {**meta_info, "id": self.rid}
        for key in LOGPROB_KEYS:
            if isinstance(meta.get(key), list):
                self._lists[key] = list(meta[key])
        meta.update(self._logprobs())
        return meta

    def _logprobs(self) -> dict[str, Any]:
        if not self.incremental:
            return {key: list(value) for key, value in self._lists.items()}
        out = {}
        for key, value in self._lists.items():
            out[key], self._sent[key] = value[self._sent.get(key, 0) :], len(value)
        return out


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
    """The front's own series: requests by endpoint and status, generate latency, in flight;
    and SGLang's request metrics (:class:`SGLangMetrics`)."""

    def __init__(self, model_name: str = "default", engine_type: str = "unified") -> None:
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
            "Time of each request to the scheduler, from sending it to its result or end (a "
            "batch, or n > 1, sends several)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "kvstack_http_inflight_requests",
            "Requests to the scheduler in flight",
            registry=self.registry,
        )
        self.source_up = Gauge(
            "kvstack_http_metrics_source_up",
            "1 if the service's metrics answered the last scrape",
            ["source"],
            registry=self.registry,
        )

        self.sglang = SGLangMetrics(self.registry, model_name, engine_type)

    def text(self) -> str:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry).decode()


# SGLang's buckets for its tokenizer-side histograms (TokenizerMetricsCollector).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip


class SGLangMetrics:
    """SGLang's tokenizer-side request metrics, under its names, buckets and labels
    (``model_name``, ``engine_type``; ``is_streaming`` where SGLang has it), so that an
    SGLang dashboard reads them: measured here, at the front, as SGLang's tokenizer
    manager measures them."""

    def __init__(self, registry: Any, model_name: str, engine_type: str) -> None:
        from prometheus_client import Counter, Histogram

        self.labels = {"model_name": model_name, "engine_type": engine_type}
        base = list(self.labels)
        streaming = [*base, "is_streaming"]

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, labels: list[str], buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.prompt_tokens = counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", streaming
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", streaming
        )
        self.cached_tokens = counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*base, "cache_source"],
        )
        self.num_requests = counter(
            "sglang:num_requests", "Number of requests processed.", streaming
        )
        self.num_aborted = counter(
            "sglang:num_aborted_requests", "Number of requests aborted.", base
        )
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            streaming,
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            base,
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            streaming,
            E2E_BUCKETS,
        )

    def _streaming(self, stream: bool) -> dict[str, str]:
        return {**self.labels, "is_streaming": "true" if stream else "false"}

    def first_token(self, seconds: float, *, stream: bool) -> None:
        self.ttft.labels(**self._streaming(stream)).observe(seconds)

    def next_tokens(self, seconds: float, num_new_tokens: int) -> None:
        """``num_new_tokens`` came ``seconds`` after the previous ones: each is observed
        at an equal share of the interval, as SGLang does."""
        if num_new_tokens <= 0:
            return
        histogram = self.itl.labels(**self.labels)
        for _ in range(num_new_tokens):
            histogram.observe(seconds / num_new_tokens)

    def finished(self, meta_info: dict[str, Any], seconds: float, *, stream: bool) -> None:
        labels = self._streaming(stream)
        self.prompt_tokens.labels(**labels).inc(int(meta_info.get("prompt_tokens", 0)))
        self.generation_tokens.labels(**labels).inc(int(meta_info.get("completion_tokens", 0)))
        cached = int(meta_info.get("cached_tokens", 0))
        if cached > 0:  # SGLang's source when it has no per-source details
            self.cached_tokens.labels(**self.labels, cache_source="total").inc(cached)
        self.num_requests.labels(**labels).inc()
        self.e2e.labels(**labels).observe(seconds)
        finish = meta_info.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            self.num_aborted.labels(**self.labels).inc()
