"""SGLang 0.5.23's request fields, and which of them kvstack honours.

Every field of SGLang's ``GenerateReqInput`` (the ``/generate`` body) and
``SamplingParams`` (its ``sampling_params``) is known here with SGLang's
default. A field kvstack honours is passed on; one it cannot honour is
accepted at its default (what SGLang's own clients send: ``lora_path: null``,
``return_logprob: false``, ``logprob_start_len: -1``...) and refused with a
400 naming it otherwise. A field in neither SGLang nor kvstack is unknown, and
also refused.

The sampling fields honoured are those of the scheduler's
:class:`scheduler_svc.protocol.GenSampling`, read when a request comes (so a
field the scheduler learns is honoured without a change here), plus the
translations :func:`sampling_to_kvstack` makes (SGLang's ``top_k: -1`` and
``sampling_seed``, ``stop`` as one string, ``null`` for "default").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# SGLang's GenerateReqInput fields that the front does not take as fields of its own
# (text, input_ids, sampling_params, stream, rid, priority, return_logprob,
# logprob_start_len, top_logprobs_num, return_text_in_logprobs, log_metrics, no_logs,
# cache_salt, extra_key are honoured: kvstack.serve.sglang.protocol.GenerateOne), with
# SGLang's defaults. ``None`` for a field whose default is None: SGLang treats null as
# "unset" for every one of them.
GENERATE_DEFAULTS: dict[str, Any] = {
    "session_id": None,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "watermark": None,
    "token_ids_logprob": None,
    "return_sampling_mask": None,
    "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None,
    "routing_key": None,
    "conversation_id": None,
    "http_worker_ipc": None,
    "background": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "custom_labels": None,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "external_trace_header": None,
    "received_time": None,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
    "kv_hints": None,
}

# The GenerateReqInput fields kvstack honours (GenerateOne's fields).
GENERATE_HONOURED = (
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "priority",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "log_metrics",
    "no_logs",
    "cache_salt",
    "extra_key",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)

# SGLang's SamplingParams, API fields then the internal ones normalize() fills in, with
# SGLang's defaults.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
    "custom_params": None,
    "watermark": None,
    "stop_strs": None,
    "stop_regex_strs": None,
    "stop_str_max_len": 0,
    "stop_regex_max_len": 0,
    "is_normalized": False,
    "ebnf_full_assistant": False,
}

# SGLang's AbortReq fields other than rid and abort_all, with their defaults.
ABORT_DEFAULTS: dict[str, Any] = {
    "finished_reason": None,
    "abort_message": None,
    "weight_versions": None,
    "http_worker_ipc": None,
}

# Sampling fields the front itself takes care of: ``n`` (parallel sampling: the front
# sends n requests) and SGLang's names for kvstack's.
FRONT_SAMPLING = ("n", "sampling_seed")
MAX_N = 64  # the most parallel samples of one prompt

TOP_K_MESSAGE = "top_k must be -1 (disable) or at least 1, got {}."


class Unsupported(Exception):
    """A field kvstack knows (SGLang has it) but cannot honour, set to a non-default value.

    Not a ValueError, so that pydantic lets it through a validator unchanged.
    """

    def __init__(self, field: str, value: Any, default: Any) -> None:
        super().__init__(
            f"{field} is not supported by kvstack (got {_short(value)}; only SGLang's "
            f"default, {_short(default)}, is accepted)"
        )
        self.field = field


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_default(value: Any, default: Any) -> bool:
    """``value`` means the default: null, equal to it, or a (batch) list of such."""
    if value is None or value == default:
        return True
    if isinstance(value, list) and value and not isinstance(default, list):
        return all(v is None or v == default for v in value)
    # SGLang treats an empty grammar / dict / list as unset too
    return default is None and value in ("", {}, [])


def honoured_sampling() -> set[str]:
    """The sampling fields the scheduler honours (its GenSampling), now."""
    from scheduler_svc.protocol import GenSampling

    return set(GenSampling.model_fields)


def sampling_names() -> set[str]:
    """Every name a sampling parameter goes by: those the scheduler honours and SGLang's."""
    return honoured_sampling() | set(SAMPLING_DEFAULTS)


def check_default_only(
    data: Mapping[str, Any], defaults: Mapping[str, Any], where: str = ""
) -> dict[str, Any]:
    """``data`` without the fields of ``defaults`` (each must be at its default)."""
    out = {}
    for name, value in data.items():
        if name in defaults:
            if not is_default(value, defaults[name]):
                raise Unsupported(f"{where}{name}", value, defaults[name])
        else:
            out[name] = value
    return out


def sampling_to_kvstack(data: Any, where: str = "sampling_params.") -> Any:
    """SGLang's ``sampling_params`` as the scheduler's GenSampling fields.

    Honoured fields pass (SGLang's spellings translated), null means the
    default, fields SGLang has but kvstack does not honour must be at their
    default (:class:`Unsupported` otherwise); anything else is left for the
    strict model to refuse as unknown. ``n`` must be gone already (the front
    handles it: :func:`pop_n`).
    """
    if not isinstance(data, Mapping):
        return data
    honoured = honoured_sampling()
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name in honoured:
            if value is None:
                continue  # null: the default, as SGLang's __post_init__ does
            out[name] = value
        elif name == "sampling_seed" and "seed" in honoured:
            if value is not None:
                out["seed"] = value
        elif name in SAMPLING_DEFAULTS:
            if not is_default(value, SAMPLING_DEFAULTS[name]):
                raise Unsupported(f"{where}{name}", value, SAMPLING_DEFAULTS[name])
        else:
            out[name] = value  # unknown: the model refuses it
    if "stop" in out and isinstance(out["stop"], str):
        out["stop"] = [out["stop"]]
    if "top_k" in out:
        top_k = out["top_k"]
        if isinstance(top_k, int) and not isinstance(top_k, bool):
            if top_k == 0 or top_k < -1:
                raise ValueError(TOP_K_MESSAGE.format(top_k))
            if top_k == -1:
                out["top_k"] = 0  # the scheduler's "off"
    return out


def pop_n(sampling: Any, where: str = "sampling_params.n") -> tuple[Any, int]:
    """``sampling`` without ``n``, and ``n`` (SGLang's parallel sampling), checked."""
    if not isinstance(sampling, Mapping) or "n" not in sampling:
        return sampling, 1
    rest = {k: v for k, v in sampling.items() if k != "n"}
    n = sampling["n"]
    if n is None:
        return rest, 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"{where}: must be an integer in 1..{MAX_N}, got {_short(n)}")
    return rest, n
