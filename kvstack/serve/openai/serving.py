"""What ``/v1/completions`` and ``/v1/chat/completions`` share: answering their requests.

Both endpoints turn a body into :class:`~kvstack.serve.sglang.protocol.GenerateOne`
requests and answer them the same way over the shared
:class:`~kvstack.serve.request_path.RequestPath`, whole or as SSE chunks:
:func:`respond`. Where their answers differ (a choice's text or message, the
logprobs' form, the object's type, the chat's opening role chunk) an
:class:`Endpoint` of each (:mod:`.serving_completion`, :mod:`.serving_chat`)
says how.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from aiohttp import web

from kvstack.serve.errors import ApiError, openai_error_body
from kvstack.serve.request_path import RequestPath
from kvstack.serve.sglang.protocol import GenerateOne
from kvstack.serve.streaming import SSE_DONE, Item, open_stream, sse, stream_text
from scheduler_svc.client import Chunk, GenerateResult


class Endpoint(Protocol):
    """How one OpenAI endpoint shapes its answers."""

    id_prefix: str  # of the answer's id
    echoes: list[str] | None  # each choice's prompt, shown before its text (completions)

    def logprobs(self, token_logprobs: list[Any], top_logprobs: list[Any]) -> dict[str, Any]:
        """The choice's ``logprobs`` from SGLang's ``[logprob, id, _]`` lists."""
        ...

    def choice(self, index: int, text: str | None, *, chunk: bool) -> dict[str, Any]:
        """Choice ``index`` with its ``text``: the scheduler's whole text (its echo added
        here), or (``chunk``) a streamed delta (its echo in it already)."""
        ...

    def answer(
        self, request_id: str, model: str, choices: list[dict], usage: dict | None, *, chunk: bool
    ) -> dict[str, Any]:
        """The answer object, or one SSE chunk of it."""
        ...

    def opening(self, num_choices: int) -> list[dict[str, Any]] | None:
        """The choices of a first SSE chunk, if the endpoint sends one before any text."""
        ...


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def finish(meta_info: dict[str, Any]) -> tuple[str | None, Any]:
    """OpenAI's ``finish_reason`` and SGLang's ``matched_stop`` from the scheduler's."""
    reason = meta_info.get("finish_reason")
    if not isinstance(reason, dict):
        return None, None
    return reason.get("type"), reason.get("matched")


def usage(results: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
    """OpenAI's usage of ``results`` (meta_infos); each prompt counted once, not ``n``
    times, as SGLang counts it."""
    prompt = sum(int(m.get("prompt_tokens", 0)) for m in results[::n])
    completion = sum(int(m.get("completion_tokens", 0)) for m in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class TokenText:
    """Each token's own text, for logprobs (special tokens shown)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)


async def respond(
    path: RequestPath,
    endpoint: Endpoint,
    request: web.Request,
    body: Any,
    ones: list[GenerateOne],
    tokenizer: Any,
) -> web.StreamResponse:
    """``ones`` sent and answered as ``endpoint`` answers: whole, or streamed if the
    body asks."""
    rids = path.rids(ones)
    gens = [path.events(one, rid, stream=body.stream) for one, rid in zip(ones, rids, strict=True)]
    request_id = new_id(endpoint.id_prefix)
    async with contextlib.AsyncExitStack() as closing:
        for gen in gens:
            closing.push_async_callback(gen.aclose)  # type: ignore[attr-defined]
        if body.stream:
            return await _stream(path, endpoint, request, body, ones, gens, request_id, tokenizer)
        results = await path.results(gens)
        choices = []
        for index, result in enumerate(results):
            reason, matched = finish(result.meta_info)
            logprobs = None
            if ones[index].return_logprob:
                lps, tops = _logprob_lists(result.meta_info, echo=endpoint.echoes is not None)
                logprobs = endpoint.logprobs(lps, tops)
            choice = endpoint.choice(index, result.text, chunk=False)
            choice.update(logprobs=logprobs, finish_reason=reason, matched_stop=matched)
            choices.append(choice)
        total = usage([r.meta_info for r in results], body.n)
        return web.json_response(
            endpoint.answer(request_id, body.model, choices, total, chunk=False)
        )


async def _stream(
    path: RequestPath,
    endpoint: Endpoint,
    request: web.Request,
    body: Any,
    ones: Sequence[GenerateOne],
    gens: Sequence[AsyncIterator[Item]],
    request_id: str,
    tokenizer: Any,
) -> web.StreamResponse:
    firsts = await path.firsts(gens)
    response = await open_stream(request)
    texts = [stream_text(tokenizer, one, incremental=True) for one in ones]
    echoes = endpoint.echoes
    sent_logprobs = [0] * len(gens)
    echoing = [echoes is not None] * len(gens)  # the prompt is still to send
    finals: dict[int, dict[str, Any]] = {}

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> bytes:
        return sse(endpoint.answer(request_id, body.model, choices, usage_, chunk=True))

    try:
        opening = endpoint.opening(len(gens))
        if opening is not None:
            await response.write(chunk(opening))
        async with contextlib.aclosing(path.merged(gens, firsts)) as merged:
            async for i, item in merged:
                if isinstance(item, Chunk):
                    delta = texts[i].chunk(item.token_ids)["text"]
                    meta = getattr(item, "meta_info", None) or {}
                    reason = matched = None
                else:
                    delta = texts[i].done(item)["text"]
                    meta = item.meta_info
                    finals[i] = meta
                    reason, matched = finish(meta)
                logprobs = None
                if echoing[i]:
                    delta = echoes[i] + delta  # type: ignore[index]
                if ones[i].return_logprob:
                    lps = meta.get("output_token_logprobs") or []
                    tops = meta.get("output_top_logprobs") or []
                    if isinstance(item, GenerateResult):  # the whole list: send the rest
                        lps, tops = lps[sent_logprobs[i] :], tops[sent_logprobs[i] :]
                    sent_logprobs[i] += len(lps)
                    if echoing[i]:  # the prompt's first (in the first chunk's meta_info)
                        inputs = list(meta.get("input_token_logprobs") or [])
                        lps = [*inputs, *lps]
                        tops = [*_tops(meta, "input", len(inputs)), *tops]
                    logprobs = endpoint.logprobs(lps, tops)
                echoing[i] = False
                if not delta and reason is None and not (logprobs and _has_tokens(logprobs)):
                    continue
                choice = endpoint.choice(i, delta, chunk=True)
                choice.update(logprobs=logprobs, finish_reason=reason, matched_stop=matched)
                await response.write(chunk([choice]))
        if body.include_usage:
            metas = [finals[i] for i in range(len(gens))]
            await response.write(chunk([], usage(metas, body.n)))
    except ApiError as exc:  # the status line is sent: report in the stream
        await response.write(sse({"error": openai_error_body(exc.status, exc.message)}))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


def _tops(meta: dict[str, Any], side: str, count: int) -> list[Any]:
    """``{side}_top_logprobs`` of ``meta``, or ``count`` Nones without it."""
    tops = meta.get(f"{side}_top_logprobs")
    return list(tops) if isinstance(tops, list) else [None] * count


def _logprob_lists(meta: dict[str, Any], *, echo: bool) -> tuple[list[Any], list[Any]]:
    """The token and top logprobs a choice shows: the output's, after the prompt's with
    ``echo``."""
    outputs = list(meta.get("output_token_logprobs") or [])
    output_tops = _tops(meta, "output", len(outputs))
    if not echo:
        return outputs, output_tops
    inputs = list(meta.get("input_token_logprobs") or [])
    return inputs + outputs, _tops(meta, "input", len(inputs)) + output_tops


def _has_tokens(logprobs: dict[str, Any]) -> bool:
    return bool(logprobs.get("tokens") or logprobs.get("content"))
