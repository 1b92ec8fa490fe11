"""OpenAI's completions and chat completions requests, as SGLang's OpenAI server takes them.

Plain functions and pydantic models, no I/O: a request body becomes the
:class:`kvstack.serve.sglang.protocol.GenerateOne` requests to send (one per
prompt and sample, in SGLang's order: prompt by prompt, each prompt's ``n``
samples together), as SGLang's OpenAI server makes ``GenerateReqInput``s.
The sampling fields map to SGLang's ``sampling_params`` in one place,
:meth:`_Request.sampling`: every field of the body that is a sampling
parameter by its name (the scheduler's :class:`~scheduler_svc.protocol.GenSampling`
or SGLang's ``SamplingParams``) passes under that name, ``max_tokens`` and
``min_tokens`` under SGLang's; so one rule (:mod:`kvstack.serve.sglang.fields`)
decides what is honoured and what is refused, and a sampling field the
scheduler learns is honoured here once the body declares it. The
fields of SGLang's request models that kvstack does not honour are accepted
at their defaults and refused (400 naming them) otherwise; unknown fields are
refused too.

``model`` is accepted whatever it names, as SGLang accepts it, and echoed in
the answer; ``GET /v1/models`` names the served model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvstack.serve.cache_keys import KEY_FIELDS, MAX_KEY_LEN
from kvstack.serve.errors import ApiError
from kvstack.serve.sglang.fields import (
    FRONT_SAMPLING,
    MAX_N,
    Unsupported,
    check_default_only,
    sampling_names,
)
from kvstack.serve.sglang.protocol import (
    MAX_TOP_LOGPROBS,
    GenerateOne,
    check_prompt_len,
    parallel_samples,
)
from scheduler_svc.protocol import EMPTY_PROMPT, MAX_PROMPT_TOKENS, Int64

DEFAULT_MODEL_NAME = "default"  # SGLang's, for a request that names no model

# Fields of SGLang's CompletionRequest / ChatCompletionRequest that kvstack does not
# honour, with their defaults (accepted at those only).
_COMMON_DEFAULTS: dict[str, Any] = {
    "logit_bias": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_cached_tokens_details": False,
    "return_spec_tokens_details": False,
    "return_token_ids": False,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "stop_regex": None,
    "lora_path": None,
    "session_id": None,
    "session_params": None,
    "response_format": None,
    "custom_params": None,
    "custom_logit_processor": None,
    "watermark": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "data_parallel_rank": None,
    "routed_dp_rank": None,
    "disagg_prefill_dp_rank": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "custom_labels": None,
}
COMPLETION_DEFAULTS: dict[str, Any] = {
    **_COMMON_DEFAULTS,
    "best_of": 1,
    "suffix": None,
}
CHAT_DEFAULTS: dict[str, Any] = {
    **_COMMON_DEFAULTS,
    "tools": None,
    "tool_choice": "auto",
    "continue_final_message": False,
    "chat_template_kwargs": None,
    "reasoning_effort": None,
    "thinking": None,
    "task": None,
    "return_prompt_token_ids": False,
    "return_meta_info": False,
    "return_input_ids_in_sglext": False,
    "return_output_ids_in_sglext": False,
    "return_sampling_mask": False,
    "sampling_logprobs_mode": None,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": True,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "use_audio_in_video": False,
    "video_config": None,
}
# OpenAI's names of SGLang's sampling parameters where they differ (max_tokens: each
# endpoint's own rule, the caller's max_new_tokens).
RENAMED = {"min_tokens": "min_new_tokens"}
# Accepted whatever their value: they change nothing kvstack does.
_IGNORED = ("user", "parallel_tool_calls", "separate_reasoning", "stream_reasoning")


# One error for a bad list, not one per element: a prompt of a million ids tried as each
# member of the union gave a 25 MB error message after 15 s.
Texts = Annotated[list[str], Field(fail_fast=True)]
Ids = Annotated[list[Int64], Field(fail_fast=True)]
IdLists = Annotated[list[Ids], Field(fail_fast=True)]


def num_prompts(prompt: Any) -> int:
    """How many prompts a (not yet validated) ``prompt`` holds: a list of ids is one."""
    if not isinstance(prompt, list):
        return 1
    if prompt and isinstance(prompt[0], int):
        return 1
    return len(prompt)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False

    @model_validator(mode="after")
    def _check(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise Unsupported("stream_options.continuous_usage_stats", True, False)
        return self


class _Request(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = DEFAULT_MODEL_NAME
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # SGLang's extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: Ids | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    priority: Int64 | None = None
    # Which cached KV the request may share (vLLM's cache_salt; SGLang's extra_key too):
    # strings, "" for none, as SGLang's OpenAI server takes them (a list is refused).
    cache_salt: str | None = Field(default=None, max_length=MAX_KEY_LEN)
    extra_key: str | None = Field(default=None, max_length=MAX_KEY_LEN)
    # SGLang's PD pairing, which its router (SMG) adds (see GenerateOne)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    sglang_defaults: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k not in _IGNORED}
        # a field the body declares is its own, whatever SGLang's list says
        defaults = {k: v for k, v in cls.sglang_defaults.items() if k not in cls.model_fields}
        return check_default_only(data, defaults)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang's ``sampling_params`` for this request (as SGLang's server maps them):
        each field that is a sampling parameter, under SGLang's name (:data:`RENAMED`)
        or its own; unset ones (null) left to their defaults."""
        names = sampling_names() - set(FRONT_SAMPLING)  # n: the front's own
        out: dict[str, Any] = {}
        for field in type(self).model_fields:
            name = RENAMED.get(field, field)
            value = getattr(self, field)
            if name in names and value is not None:
                out[name] = value
        if max_new_tokens is not None:
            out["max_new_tokens"] = max_new_tokens
        return out


class CompletionIn(_Request):
    """The body of ``POST /v1/completions``."""

    sglang_defaults: ClassVar[dict[str, Any]] = COMPLETION_DEFAULTS

    prompt: str | Texts | Ids | IdLists
    max_tokens: int = Field(default=16, ge=1, le=1 << 20)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # the prompt before the completion (with logprobs: the prompt's logprobs too)
    echo: bool = False

    @model_validator(mode="before")
    @classmethod
    def _long_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and num_prompts(data.get("prompt")) == 1:
            check_prompt_len(data.get("prompt"), "prompt")
        return data

    def prompts(self) -> list[dict[str, Any]]:
        """Each prompt as ``{"text": ...}`` or ``{"input_ids": ...}``."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [{"text": prompt}]
        if not prompt:
            raise ValueError(EMPTY_PROMPT)
        if all(isinstance(p, str) for p in prompt):
            return [{"text": p} for p in prompt]  # type: ignore[misc]
        if all(isinstance(p, int) for p in prompt):
            return [{"input_ids": list(prompt)}]
        return [{"input_ids": list(p)} for p in prompt]  # type: ignore[arg-type]


class ChatIn(_Request):
    """The body of ``POST /v1/chat/completions``."""

    sglang_defaults: ClassVar[dict[str, Any]] = CHAT_DEFAULTS

    messages: list[dict[str, Any]] = Field(
        min_length=1, max_length=MAX_PROMPT_TOKENS, fail_fast=True
    )
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check(self) -> ChatIn:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def generate_ones(
    request: _Request,
    prompts: Sequence[dict[str, Any]],
    *,
    max_new_tokens: Sequence[int | None],
    top_logprobs: int | None,
    prompt_logprobs: bool = False,
) -> list[GenerateOne]:
    """The requests to send: each prompt ``n`` times; ``top_logprobs`` None: no logprobs;
    ``prompt_logprobs``: the prompt's too (``echo``)."""
    out = []
    for i, prompt in enumerate(prompts):
        body: dict[str, Any] = {**prompt, "sampling_params": request.sampling(max_new_tokens[i])}
        if request.rid is not None:
            body["rid"] = request.rid if len(prompts) == 1 else f"{request.rid}_{i}"
        if request.priority is not None:
            body["priority"] = request.priority
        for name in KEY_FIELDS:
            if getattr(request, name):  # "" is none, as in SGLang's _compute_extra_key
                body[name] = getattr(request, name)
        for name in BOOTSTRAP_FIELDS:
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        if top_logprobs is not None:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs)
            if prompt_logprobs:
                body["logprob_start_len"] = 0
        try:
            one = GenerateOne.model_validate(body)
        except Unsupported as exc:
            field = exc.field.removeprefix("sampling_params.")
            message = str(exc).replace("sampling_params.", "")
            raise ApiError(400, "unsupported_field", message, param=field) from None
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = [str(p) for p in err["loc"] if p != "sampling_params"]
            param = ".".join(loc) or None
            message = f"{param}: {err['msg']}" if param else err["msg"]
            raise ApiError(400, "invalid_request", message, param=param) from None
        except ValueError as exc:
            raise ApiError(400, "invalid_request", str(exc)) from None
        out += parallel_samples(one.check_prompt(), request.n)
    return out
