"""Streamed answers: SSE framing, and the text and ``meta_info`` of each streamed chunk.

Both endpoint families stream through these: SGLang's ``/generate`` sends
:class:`StreamText` payloads with :class:`StreamMeta`'s ``meta_info``; the
OpenAI endpoints send :class:`StreamText`'s new text as each choice's delta.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from scheduler_svc.client import Chunk, GenerateResult


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


async def open_stream(request: web.Request) -> web.StreamResponse:
    """An SSE answer to ``request``, its status line sent."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response
