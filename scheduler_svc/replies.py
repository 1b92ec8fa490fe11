"""What the scheduler sends back for a ``generate``: stream chunks, the done reply, errors.

A request's replies go to the client that submitted it (:class:`Waiter`: its
socket identity and op_id, and how much of the output it has had). A chunk
carries the output tokens it has not had yet and their logprobs; the done
reply the whole output, its text (decoded and trimmed as SGLang does) and
``meta_info`` with SGLang's keys. Headers are plain maps, packed by the caller
(:func:`error_reply` packs its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memsvc import protocol as wire
from scheduler_svc.core import FinishAbort, FinishMatchedStr, FinishMatchedToken, Req


@dataclass
class Waiter:
    """Where a request's replies go."""

    identity: bytes | None  # None: an adopted request whose client has not re-attached
    op_id: int
    stream: bool
    started: float
    sent: int = 0  # output tokens already streamed
    fingerprint: str = ""  # input + sampling: a re-submission must match it
    client: str = ""  # the client that owns the rid: only it may re-submit or abort it
    # max_new_tokens 0 with prompt logprobs (scoring): one token is run, none returned.
    scoring: bool = False
    # Told ``moved`` (the peer's address) when the request moves to another decode node,
    # rather than relayed its replies (scheduler_svc.pd.migrate).
    follow_moves: bool = False


def chunk_header(req: Req, waiter: Waiter, now: float) -> dict[str, Any] | None:
    """The stream chunk of what ``waiter`` has not had of ``req``'s output yet (None:
    nothing new, or not streamed): those tokens, with their logprobs."""
    if not (waiter.stream and len(req.output_ids) > waiter.sent):
        return None
    end = len(req.output_ids)
    meta = meta_info(req, now - waiter.started)
    del meta["finish_reason"]
    return {
        "ok": True,
        "op_id": waiter.op_id,
        "type": "chunk",
        "rid": req.rid,
        "token_ids": req.output_ids[waiter.sent :],
        "offset": waiter.sent,
        "meta_info": {
            **meta,
            **logprob_meta(req, waiter.sent, end, inputs=waiter.sent == 0),
        },
    }


def done_header(req: Req, waiter: Waiter, now: float, tokenizer: Any) -> dict[str, Any]:
    """The final reply: the whole output, its text and ``meta_info``. A scoring request
    (:attr:`Waiter.scoring`) returns none of the token it ran."""
    meta = meta_info(req, now - waiter.started)
    num_out = len(req.output_ids)
    if waiter.scoring:  # one token was run for the prompt's logprobs: none is returned
        num_out = 0
        meta["completion_tokens"] = 0
        if not isinstance(req.finish_reason, FinishAbort):
            meta["finish_reason"] = {"type": "length", "length": 0}
    return {
        "ok": True,
        "op_id": waiter.op_id,
        "type": "done",
        "rid": req.rid,
        "output_ids": list(req.output_ids[:num_out]),
        "text": output_text(tokenizer, req) if num_out else "",
        "meta_info": {**meta, **logprob_meta(req, 0, num_out, inputs=True)},
    }


def nothing_to_generate(req: Req, op_id: int) -> dict[str, Any]:
    """The done reply of a request with ``max_new_tokens`` 0 (and no prompt logprobs to
    score): answered at once, nothing run."""
    return {
        "ok": True,
        "op_id": op_id,
        "type": "done",
        "rid": req.rid,
        "output_ids": [],
        "text": "",
        "meta_info": {
            **meta_info(req, 0.0),
            **logprob_meta(req, 0, 0, inputs=True),
            "finish_reason": {"type": "length", "length": 0},
        },
    }


def output_text(tokenizer: Any, req: Req) -> str:
    """The output's text: decoded as ``skip_special_tokens`` says, cut before the
    matched stop string or stop token unless ``no_stop_trim`` (as SGLang)."""
    params = req.sampling_params
    ids = req.output_ids
    reason = req.finish_reason
    trim = not params.no_stop_trim
    if trim and isinstance(reason, FinishMatchedToken) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special=params.skip_special_tokens)
    if trim and isinstance(reason, FinishMatchedStr):
        at = text.find(reason.matched)
        if at != -1:
            text = text[:at]
    return text


def meta_info(req: Req, e2e_latency: float) -> dict[str, Any]:
    """SGLang's ``meta_info`` of a reply (the logprob keys aside)."""
    reason = req.finish_reason.to_json() if req.finish_reason else None
    meta = {
        "finish_reason": reason,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "num_retractions": req.retraction_count,
        "e2e_latency": e2e_latency,
    }
    # Hierarchical cache: the hit per tier, as SGLang (only when something was cached).
    if req.cached_tokens_details is not None and req.cached_tokens > 0:
        meta["cached_tokens_details"] = dict(req.cached_tokens_details)
    return meta


def logprob_meta(req: Req, start: int, end: int, *, inputs: bool) -> dict[str, Any]:
    """SGLang's logprob keys of ``meta_info`` (none without ``return_logprob``): output
    positions ``start..end-1``, and the prompt's with ``inputs``. Entries are
    ``[logprob, token_id, None]`` (SGLang's, with return_text_in_logprobs false)."""
    if not req.return_logprob:
        return {}
    state = req.logprob
    meta: dict[str, Any] = {
        "output_token_logprobs": [
            [value, token, None]
            for value, token in zip(
                state.output_vals[start:end], req.output_ids[start:end], strict=False
            )
        ]
    }
    top = req.top_logprobs_num > 0
    if top:
        meta["output_top_logprobs"] = [_top_entry(entry) for entry in state.output_tops[start:end]]
    if inputs:
        prompt = req.origin_input_ids[req.logprob_start_len :] if state.input_done else []
        meta["input_token_logprobs"] = [
            [value, token, None] for value, token in zip(state.input_vals, prompt, strict=False)
        ]
        if top:
            tops = state.input_tops if state.input_done else []
            meta["input_top_logprobs"] = [_top_entry(entry) for entry in tops]
    return meta


def _top_entry(entry: Any) -> list[list[Any]] | None:
    """One position's top logprobs, ``[[logprob, token_id, None], ...]``, or None."""
    if entry is None:
        return None
    return [[value, token, None] for value, token in entry]


def error_reply(op_id: int | None, code: str, message: str, status_code: int) -> list[bytes]:
    """An error reply, packed."""
    return wire.pack(
        {"ok": False, "op_id": op_id, "code": code, "message": message, "status_code": status_code}
    )
