"""``POST /v1/chat/completions``: a conversation rendered by the model's chat template.

The messages are rendered and tokenized (in a worker thread for a large
body: the tokenizer's time grows with the text), and each of the ``n``
samples is one scheduler request; without ``max_tokens`` a chat may use
what the context has left, as SGLang's does. Answered by
:func:`.serving.respond`, shaped by :class:`ChatEndpoint`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvstack.serve.body import check_batch
from kvstack.serve.errors import ApiError
from kvstack.serve.openai import protocol as oai
from kvstack.serve.openai.serving import TokenText, respond
from kvstack.serve.request_path import RequestPath
from kvstack.serve.sglang.protocol import validate_body
from scheduler_svc.protocol import MAX_PROMPT_TOKENS


class OpenAIServingChat:
    """``/v1/chat/completions`` over the shared request path."""

    def __init__(self, path: RequestPath, tokenizer: Any, served_model_name: str) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name

    async def create_chat_completion(self, request: web.Request) -> web.StreamResponse:
        body, input_ids = await self.path.parsed(request, self.prompt)
        max_new = body.max_completion_tokens or body.max_tokens
        if max_new is None:  # SGLang's: what the context has left
            max_new = max(1, await self.path.context_len() - len(input_ids))
        top = (body.top_logprobs or 0) if body.logprobs else None
        ones = oai.generate_ones(
            body, [{"input_ids": input_ids}], max_new_tokens=[max_new], top_logprobs=top
        )
        endpoint = ChatEndpoint(TokenText(self.tokenizer))
        return await respond(self.path, endpoint, request, body, ones, self.tokenizer)

    def prompt(self, data: Any) -> tuple[oai.ChatIn, list[int]]:
        """The body and its messages rendered and tokenized."""
        body: oai.ChatIn = validate_body(oai.ChatIn, data)
        check_batch(1, body.n, self.path.limits.max_batch_requests, "n")
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


class ChatEndpoint:
    """How ``/v1/chat/completions`` shapes its answers (:class:`.serving.Endpoint`)."""

    id_prefix = "chatcmpl-"
    echoes = None

    def __init__(self, text: TokenText) -> None:
        self.text = text

    def logprobs(self, token_logprobs: list[Any], top_logprobs: list[Any]) -> dict[str, Any]:
        return chat_logprobs(token_logprobs, top_logprobs, self.text)

    def choice(self, index: int, text: str | None, *, chunk: bool) -> dict[str, Any]:
        if chunk:
            return {"index": index, "delta": {"content": text}}
        message = {"role": "assistant", "content": text, "reasoning_content": None}
        return {"index": index, "message": message}

    def answer(
        self, request_id: str, model: str, choices: list[dict], usage: dict | None, *, chunk: bool
    ) -> dict[str, Any]:
        return chat_object(request_id, model, choices, usage, chunk=chunk)

    def opening(self, num_choices: int) -> list[dict[str, Any]]:
        """The role first, as SGLang (and OpenAI) do."""
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(num_choices)
        ]


def chat_logprobs(
    token_logprobs: Sequence[Any] | None, top_logprobs: Sequence[Any] | None, text: TokenText
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` (``{"content": [...]}``) from SGLang's lists."""

    def entry(logprob: float, token_id: int) -> dict[str, Any]:
        token = text(token_id)
        return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": logprob}

    tops = list(top_logprobs or [])
    content = []
    for i, (logprob, token_id, *_) in enumerate(token_logprobs or []):
        top = tops[i] if i < len(tops) else None
        content.append(
            {**entry(logprob, token_id), "top_logprobs": [entry(t[0], t[1]) for t in top or []]}
        )
    return {"content": content}


def chat_object(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any] | None,
    *,
    chunk: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body
