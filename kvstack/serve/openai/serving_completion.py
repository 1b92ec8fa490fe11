"""``POST /v1/completions``: prompts (text, ids, lists of either) completed, SGLang style.

A body (:class:`.protocol.CompletionIn`) becomes one scheduler request per
prompt and sample; with ``echo`` each choice shows its prompt first (with
logprobs, the prompt's logprobs too). Answered by :func:`.serving.respond`,
shaped by :class:`CompletionEndpoint`.
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
from kvstack.serve.sglang.protocol import GenerateOne, validate_body


class OpenAIServingCompletion:
    """``/v1/completions`` over the shared request path."""

    def __init__(self, path: RequestPath, tokenizer: Any) -> None:
        self.path = path
        self.tokenizer = tokenizer

    async def create_completion(self, request: web.Request) -> web.StreamResponse:
        cap = self.path.limits.max_batch_requests
        body, ones, echoes = await self.path.parsed(request, lambda data: self.requests(data, cap))
        endpoint = CompletionEndpoint(TokenText(self.tokenizer), echoes)
        return await respond(self.path, endpoint, request, body, ones, self.tokenizer)

    def requests(
        self, data: Any, max_requests: int
    ) -> tuple[oai.CompletionIn, list[GenerateOne], list[str] | None]:
        """The body, its scheduler requests, and with ``echo`` each choice's prompt."""
        if isinstance(data, dict):  # a prompt list past the cap: refused before its items
            check_batch(oai.num_prompts(data.get("prompt")), 1, max_requests, "prompt")
        body: oai.CompletionIn = validate_body(oai.CompletionIn, data)
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


class CompletionEndpoint:
    """How ``/v1/completions`` shapes its answers (:class:`.serving.Endpoint`)."""

    id_prefix = "cmpl-"

    def __init__(self, text: TokenText, echoes: list[str] | None) -> None:
        self.text = text
        self.echoes = echoes

    def logprobs(self, token_logprobs: list[Any], top_logprobs: list[Any]) -> dict[str, Any]:
        return completion_logprobs(token_logprobs, top_logprobs, self.text)

    def choice(self, index: int, text: str | None, *, chunk: bool) -> dict[str, Any]:
        if not chunk:
            text = (self.echoes[index] if self.echoes else "") + (text or "")
        return {"index": index, "text": text}

    def answer(
        self, request_id: str, model: str, choices: list[dict], usage: dict | None, *, chunk: bool
    ) -> dict[str, Any]:
        return completion_object(request_id, model, choices, usage)

    def opening(self, num_choices: int) -> None:
        return None


def completion_logprobs(
    token_logprobs: Sequence[Any] | None,
    top_logprobs: Sequence[Any] | None,
    text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` from SGLang's ``[logprob, id, _]`` lists;
    ``offset``: where in the text the first token starts."""
    out: dict[str, Any] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    tops = list(top_logprobs or [])
    for i, (logprob, token_id, *_) in enumerate(token_logprobs or []):
        token = text(token_id)
        out["text_offset"].append(offset)
        offset += len(token)
        out["token_logprobs"].append(logprob)
        out["tokens"].append(token)
        top = tops[i] if i < len(tops) else None
        if top is None:
            out["top_logprobs"].append(None)
        else:
            out["top_logprobs"].append({text(t[1]): t[0] for t in top})
    return out


def completion_object(
    request_id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
