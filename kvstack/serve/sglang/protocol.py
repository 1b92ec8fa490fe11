"""SGLang's native request bodies: ``/generate`` (single and batch) and ``/abort_request``.

Plain pydantic models and functions, no I/O, so they are tested without a
server. A ``/generate`` body is validated strictly into the requests to send,
one :class:`GenerateOne` (SGLang's ``GenerateReqInput`` for one prompt) per
prompt and sample; SGLang's fields kvstack does not honour are accepted only
at their defaults (:mod:`.fields`) and unknown fields are refused. The OpenAI
endpoints build the same :class:`GenerateOne` requests, as SGLang's OpenAI
server builds ``GenerateReqInput``.

:class:`SamplingParamsIn` is where SGLang's ``sampling_params`` become the
scheduler's one sampling record, :class:`scheduler_svc.protocol.GenSampling`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstack.serve.body import check_batch
from kvstack.serve.cache_keys import KEY_FIELDS, MAX_KEY_LEN, split_keys
from kvstack.serve.errors import ApiError, validation_message
from kvstack.serve.limits import DEFAULT_MAX_BATCH_REQUESTS
from kvstack.serve.sglang.fields import (
    ABORT_DEFAULTS,
    GENERATE_DEFAULTS,
    Unsupported,
    check_default_only,
    pop_n,
    sampling_to_kvstack,
)
from scheduler_svc import protocol as _protocol
from scheduler_svc.protocol import EMPTY_PROMPT, MAX_PROMPT_TOKENS, GenSampling, Int64


class SamplingParamsIn(GenSampling):
    """SGLang's ``sampling_params``: the scheduler's fields and bounds, types checked strictly.

    SGLang's spellings are translated first (:func:`.fields.sampling_to_kvstack`:
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
    # Which cached KV the request may share (:mod:`.cache_keys`; "" is None there).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LEN)
    extra_key: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LEN)
    # SGLang's PD pairing, which its router (SMG) adds: honoured by a prefill or decode
    # node (kvstack.serve.pairing), refused elsewhere.
    bootstrap_host: str | None = Field(default=None, min_length=1, max_length=256)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_room: int | None = Field(default=None, ge=0, lt=2**63)

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
    data = without_router_model(data)
    try:
        fields = check_default_only(data, GENERATE_DEFAULTS)
    except Unsupported as exc:
        raise ApiError(400, "unsupported_field", str(exc), param=exc.field) from None
    size = _batch_size(fields)
    check_batch(size or 1, 1, max_requests)
    keys = split_keys(fields, size)
    prompts = []
    for i in range(size or 1):
        item = {k: v for k, v in fields.items() if k not in KEY_FIELDS}
        item.update({k: v for k, v in keys[i].items() if v is not None})
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
            raise ApiError(400, "invalid_request", validation_message(exc, where)) from None
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        check_batch(size or 1, n, max_requests)
        items += parallel_samples(one.check_prompt(), n)
    batch = size is not None or len(items) > 1
    return GenerateBatch(items, batch, bool(fields.get("stream", False)))


def without_router_model(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without ``model``, which SGLang's router (SMG) adds to every ``/generate``
    (``"unknown"`` when the client named none). ``GenerateReqInput`` has no such field and
    SGLang's server ignores it, as it ignores every unknown key; kvstack refuses unknown
    keys, so this one is taken (a string or null) and dropped."""
    if "model" not in data:
        return data
    model = data["model"]
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "invalid_request", "model: must be a string")
    return {k: v for k, v in data.items() if k != "model"}


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


def validate_body(model: type[BaseModel], data: Any) -> Any:
    """``data`` as ``model``; :class:`ApiError` 400 naming what is wrong otherwise (its
    ``param``, OpenAI's, the first field named)."""
    try:
        return model.model_validate(data)
    except Unsupported as exc:
        raise ApiError(400, "unsupported_field", str(exc), param=exc.field) from None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        message = validation_message(exc)
        raise ApiError(400, "invalid_request", message, param=param or None) from None
