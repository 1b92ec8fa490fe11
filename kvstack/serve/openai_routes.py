"""The OpenAI-compatible routes of ``kvstack serve``: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``.

:class:`OpenAIRoutes` is a part of :class:`kvstack.serve.app.HttpFront` (its base): it
turns OpenAI bodies (:mod:`kvstack.serve.openai_api`) into the front's scheduler
requests and their results and streams into OpenAI's answers and SSE chunks, with
the front's own machinery (``_events``, ``_results``, ``_merged``, ``_info``...).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from kvstack.serve import openai_api as oai
from kvstack.serve.api import (
    SSE_DONE,
    ApiError,
    GenerateOne,
    Item,
    check_batch,
    openai_error_body,
    sse,
    stream_text,
)
from scheduler_svc.client import Chunk, GenerateResult
from scheduler_svc.protocol import MAX_PROMPT_TOKENS


class OpenAIRoutes:
    """The ``/v1`` handlers of :class:`~kvstack.serve.app.HttpFront`."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        cap = self.limits.max_batch_requests
        body, ones, echoes = await self._parsed(
            request, lambda data: self._completion_requests(data, cap)
        )
        return await self._openai(request, body, ones, chat=False, echoes=echoes)

    def _completion_requests(
        self, data: Any, max_requests: int
    ) -> tuple[oai.CompletionIn, list[GenerateOne], list[str] | None]:
        """The body, its scheduler requests, and with ``echo`` each choice's prompt."""
        if isinstance(data, dict):  # a prompt list past the cap: refused before its items
            check_batch(oai.num_prompts(data.get("prompt")), 1, max_requests, "prompt")
        body: oai.CompletionIn = oai.parse_openai(oai.CompletionIn, data)
        try:
            prompts = body.prompts()
        except ValueError as exc:  # SGLang names no param for an empty prompt
            raise ApiError(400, "invalid_request", str(exc)) from None
        check_batch(len(prompts), body.n, max_requests, "n" if body.n > 1 else "prompt")
        ones = oai.generate_ones(
            body,
            prompts,
            max_new_tokens=[body.max_tokens] * len(prompts),
            top_logprobs=body.logprobs,
            prompt_logprobs=body.echo,
        )
        echoes = None
        if body.echo:  # each choice's prompt, as text
            texts = [
                p["text"] if "text" in p else self.tokenizer.decode(p["input_ids"]) for p in prompts
            ]
            echoes = [text for text in texts for _ in range(body.n)]
        return body, ones, echoes

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, input_ids = await self._parsed(request, self._chat_prompt)
        max_new = body.max_completion_tokens or body.max_tokens
        if max_new is None:  # SGLang's: what the context has left
            max_new = max(1, await self._context_len() - len(input_ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        ones = oai.generate_ones(
            body, [{"input_ids": input_ids}], max_new_tokens=[max_new], top_logprobs=top
        )
        return await self._openai(request, body, ones, chat=True)

    def _chat_prompt(self, data: Any) -> tuple[oai.ChatIn, list[int]]:
        """The body and its messages rendered and tokenized (in a worker thread when the
        body is large: the tokenizer's time grows with the text)."""
        body: oai.ChatIn = oai.parse_openai(oai.ChatIn, data)
        check_batch(1, body.n, self.limits.max_batch_requests, "n")
        from model_svc.chat_template import ChatTemplateError

        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ApiError(
                400,
                "no_chat_template",
                f"the model {self.served_model_name} has no chat template (no "
                "chat_template.jinja, no chat_template in tokenizer_config.json); use "
                "/v1/completions",
            )
        try:
            rendered = template.render(body.messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise ApiError(400, "invalid_request", str(exc), param="messages") from None
        if len(rendered) > MAX_PROMPT_TOKENS:  # as /generate's text: tokenizing costs by length
            raise ApiError(
                400,
                "invalid_request",
                f"messages: the conversation is {len(rendered)} characters as a prompt; at "
                f"most {MAX_PROMPT_TOKENS}",
                param="messages",
            )
        return body, self.tokenizer.encode(rendered, add_bos=False)

    async def _context_len(self) -> int:
        if self._max_context_len is None:
            self._max_context_len = int((await self._info())["max_context_len"])
        return self._max_context_len

    async def _openai(
        self,
        request: web.Request,
        body: Any,
        ones: list[GenerateOne],
        *,
        chat: bool,
        echoes: list[str] | None = None,
    ) -> web.StreamResponse:
        rids = self._rids(ones)
        gens = [
            self._events(one, rid, stream=body.stream) for one, rid in zip(ones, rids, strict=True)
        ]
        request_id = oai.new_id("chatcmpl-" if chat else "cmpl-")
        text = oai.TokenText(self.tokenizer)
        async with contextlib.AsyncExitStack() as closing:
            for gen in gens:
                closing.push_async_callback(gen.aclose)  # type: ignore[attr-defined]
            if body.stream:
                return await self._openai_stream(
                    request, body, ones, gens, request_id, chat=chat, echoes=echoes
                )
            results = await self._results(gens)
            choices = []
            for index, result in enumerate(results):
                reason, matched = oai.finish(result.meta_info)
                choice: dict[str, Any] = {"index": index}
                logprobs = None
                meta = result.meta_info
                if ones[index].return_logprob:
                    if chat:
                        logprobs = oai.chat_logprobs(
                            meta.get("output_token_logprobs"), meta.get("output_top_logprobs"), text
                        )
                    else:
                        lps, tops = _completion_lists(meta, echo=echoes is not None)
                        logprobs = oai.completion_logprobs(lps, tops, text)
                if chat:
                    choice["message"] = {
                        "role": "assistant",
                        "content": result.text,
                        "reasoning_content": None,
                    }
                else:
                    choice["text"] = (echoes[index] if echoes else "") + (result.text or "")
                choice.update(logprobs=logprobs, finish_reason=reason, matched_stop=matched)
                choices.append(choice)
            usage = oai.usage([r.meta_info for r in results], body.n)
            if chat:
                answer = oai.chat_object(request_id, body.model, choices, usage, chunk=False)
            else:
                answer = oai.completion_object(request_id, body.model, choices, usage)
            return web.json_response(answer)

    async def _openai_stream(
        self,
        request: web.Request,
        body: Any,
        ones: Sequence[GenerateOne],
        gens: Sequence[AsyncIterator[Item]],
        request_id: str,
        *,
        chat: bool,
        echoes: list[str] | None = None,
    ) -> web.StreamResponse:
        firsts = await self._firsts(gens)
        response = await self._open_stream(request)
        texts = [stream_text(self.tokenizer, one, incremental=True) for one in ones]
        token_text = oai.TokenText(self.tokenizer)
        sent_logprobs = [0] * len(gens)
        echoing = [echoes is not None] * len(gens)  # the prompt is still to send
        finals: dict[int, dict[str, Any]] = {}

        def obj(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict:
            if chat:
                return oai.chat_object(request_id, body.model, choices, usage, chunk=True)
            return oai.completion_object(request_id, body.model, choices, usage)

        try:
            if chat:  # the role first, as SGLang (and OpenAI) do
                await response.write(
                    sse(
                        obj(
                            [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                                for i in range(len(gens))
                            ]
                        )
                    )
                )
            async with contextlib.aclosing(self._merged(gens, firsts)) as merged:
                async for i, item in merged:
                    if isinstance(item, Chunk):
                        delta = texts[i].chunk(item.token_ids)["text"]
                        meta = getattr(item, "meta_info", None) or {}
                        reason = matched = None
                    else:
                        delta = texts[i].done(item)["text"]
                        meta = item.meta_info
                        finals[i] = meta
                        reason, matched = oai.finish(meta)
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
                        if chat:
                            logprobs = oai.chat_logprobs(lps, tops, token_text)
                        else:
                            logprobs = oai.completion_logprobs(lps, tops, token_text)
                    echoing[i] = False
                    if not delta and reason is None and not (logprobs and _has_tokens(logprobs)):
                        continue
                    choice: dict[str, Any] = {"index": i}
                    if chat:
                        choice["delta"] = {"content": delta}
                    else:
                        choice["text"] = delta
                    choice.update(logprobs=logprobs, finish_reason=reason, matched_stop=matched)
                    await response.write(sse(obj([choice])))
            if body.include_usage:
                metas = [finals[i] for i in range(len(gens))]
                await response.write(sse(obj([], oai.usage(metas, body.n))))
        except ApiError as exc:  # the status line is sent: report in the stream
            await response.write(sse({"error": openai_error_body(exc.status, exc.message)}))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    async def list_models(self, request: web.Request) -> web.Response:
        card = oai.model_card(self.served_model_name, await self._context_len_or_none())
        return web.json_response({"object": "list", "data": [card]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model != self.served_model_name:
            raise ApiError(404, "model_not_found", f"The model '{model}' does not exist", "model")
        return web.json_response(
            oai.model_card(self.served_model_name, await self._context_len_or_none())
        )

    async def _context_len_or_none(self) -> int | None:
        try:
            return await self._context_len()
        except ApiError:
            return None


def _tops(meta: dict[str, Any], side: str, count: int) -> list[Any]:
    """``{side}_top_logprobs`` of ``meta``, or ``count`` Nones without it."""
    tops = meta.get(f"{side}_top_logprobs")
    return list(tops) if isinstance(tops, list) else [None] * count


def _completion_lists(meta: dict[str, Any], *, echo: bool) -> tuple[list[Any], list[Any]]:
    """The token and top logprobs a completion shows: the output's, after the prompt's
    with ``echo``."""
    outputs = list(meta.get("output_token_logprobs") or [])
    output_tops = _tops(meta, "output", len(outputs))
    if not echo:
        return outputs, output_tops
    inputs = list(meta.get("input_token_logprobs") or [])
    return inputs + outputs, _tops(meta, "input", len(inputs)) + output_tops


def _has_tokens(logprobs: dict[str, Any]) -> bool:
    return bool(logprobs.get("tokens") or logprobs.get("content"))
