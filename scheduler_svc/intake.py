"""Intake: what a ``generate`` must pass, and the request it becomes.

SGLang's checks (:func:`refusal`), each a 400 with SGLang's message: an empty
prompt, a token id outside the vocabulary, a prompt of ``max_context_len``
tokens or more, a prompt plus ``max_new_tokens`` past ``max_context_len``, a
``logprob_start_len`` past the prompt, logprobs on a PD node. Then the rules
that keep a request from waiting forever (:func:`new_req`): an input that can
never fit the pool is rejected with 400 (for a hybrid model, either pool:
:func:`~scheduler_svc.core.swa_intake.check_swa_fits`), and ``max_new_tokens``
is clamped so that one request alone always fits. :func:`fingerprint` tells a client's
re-submission of a live rid from another request under the same rid.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from scheduler_svc import protocol as p
from scheduler_svc.core import (
    Req,
    SamplingParams,
    SchedulerConfig,
    check_fits,
    clamp_max_new_tokens,
)
from scheduler_svc.core.swa_budget import SwaSpec
from scheduler_svc.core.swa_intake import check_swa_fits

DRAINING = "this decode node is draining (its requests move to another one)"


def out_of_vocabulary(token_ids: list[int], vocab_size: int) -> str | None:
    """SGLang's message for the first token id outside the vocabulary, if any."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is None:
        return None
    return f"Token ID {bad} is out of vocabulary (vocab size: {vocab_size})"


def refusal(
    input_ids: list[int], msg: Any, *, vocab_size: int, max_context_len: int, mode: str
) -> tuple[str, str, int] | None:
    """SGLang's intake checks: (code, message, status) of the first that fails."""
    num = len(input_ids)
    if num == 0:  # a text that tokenizes to nothing: nothing to prefill
        return "bad_request", p.EMPTY_PROMPT, 400
    bad = out_of_vocabulary(input_ids, vocab_size)
    if bad is not None:
        return "bad_request", bad, 400
    context = max_context_len
    if num >= context:
        message = (
            f"The input ({num} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
        return "too_large", message, 400
    max_new = msg.sampling.max_new_tokens
    if num + max_new > context:
        message = (
            "Requested token count exceeds the model's maximum context length of "
            f"{context} tokens. You requested a total of {num + max_new} tokens: {num} "
            f"tokens from the input messages and {max_new} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion "
            "to fit within the limit."
        )
        return "too_large", message, 400
    if msg.return_logprob and mode != "normal":
        message = "return_logprob is not supported in PD (prefill/decode) mode"
        return "bad_request", message, 400
    if msg.return_logprob and msg.logprob_start_len > num:
        message = (
            f"logprob_start_len={msg.logprob_start_len} is higher than the number of "
            f"input tokens len(origin_input_ids)={num}. Please use a smaller "
            "logprob_start_len."
        )
        return "bad_request", message, 400
    return None


def new_req(
    msg: Any,
    input_ids: list[int],
    *,
    capacity: int,
    page_size: int,
    mode: str,
    stop_decoder: Callable[[list[int]], str],
    swa: SwaSpec | None = None,
    config: SchedulerConfig | None = None,
) -> tuple[Req, bool]:
    """The request ``msg`` asks for, and whether it only scores its prompt.

    Raises :class:`~scheduler_svc.core.RequestTooLargeError` for an input that can
    never fit the pool; ``max_new_tokens`` is clamped so that it alone always fits
    (and to 1 on a prefill node). Scoring (``max_new_tokens`` 0 with prompt
    logprobs) runs one token and returns none. ``swa``: the SWA pool of a hybrid
    model, whose requirement (under ``config``'s reserve and chunk size) the
    request must fit too.
    """
    check_fits(len(input_ids), capacity, page_size)
    sampling = msg.sampling
    max_new = clamp_max_new_tokens(len(input_ids), sampling.max_new_tokens, capacity, page_size)
    if mode == "prefill":
        max_new = min(max_new, 1)  # the decode node generates the rest
    if swa is not None:
        check_swa_fits(
            len(input_ids),
            swa,
            mode=mode,
            reserved=config.num_reserved_decode_tokens if config else 0,
            chunked_prefill_size=config.chunked_prefill_size if config else None,
            # what admission's SWA check reserves for the output (min(max_new, clip))
            max_new_tokens=min(max_new, config.clip_max_new_tokens) if config else 1,
        )
    start = msg.logprob_start_len if msg.return_logprob else -1
    if msg.return_logprob and start == -1:
        start = len(input_ids)  # SGLang: output logprobs only
    scoring = max_new == 0 and 0 <= start < len(input_ids)
    req = Req(
        msg.rid,
        input_ids,
        SamplingParams.of(
            sampling.model_dump(),
            max_new_tokens=1 if scoring else max_new,
            ignore_eos=sampling.ignore_eos or scoring,
        ),
        priority=msg.priority,
        bootstrap_room=msg.bootstrap_room,
        bootstrap_rid=msg.bootstrap_rid,
        bootstrap_peer=msg.bootstrap_peer,
        namespace=msg.namespace,
        return_logprob=msg.return_logprob,
        logprob_start_len=start,
        top_logprobs_num=msg.top_logprobs_num if msg.return_logprob else 0,
        stop_decoder=stop_decoder if sampling.stop else None,
    )
    return req, scoring


def fingerprint(input_ids: list[int], msg: Any) -> str:
    """What makes two submissions of one rid the same request."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(input_ids).encode())
    digest.update(msg.sampling.model_dump_json().encode())
    digest.update(repr(msg.priority).encode())
    digest.update(msg.namespace.encode())
    digest.update(repr((msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num)).encode())
    return digest.hexdigest()
