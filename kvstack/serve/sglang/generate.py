"""SGLang's ``/generate``: single and batch bodies, answered whole or streamed as SSE.

Each prompt and sample of a body (:func:`.protocol.parse_generate`) is one
scheduler request on the shared :class:`~kvstack.serve.request_path.RequestPath`;
a batch is answered with a list (streamed: each chunk with its ``index``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aiohttp import web

from kvstack.serve.errors import ApiError
from kvstack.serve.request_path import RequestPath
from kvstack.serve.sglang.protocol import GenerateOne, parse_generate
from kvstack.serve.streaming import (
    SSE_DONE,
    Item,
    StreamMeta,
    open_stream,
    sse,
    stream_text,
    with_logprob_text,
)
from scheduler_svc.client import Chunk


class SGLangGenerate:
    """``/generate`` over the shared request path."""

    def __init__(self, path: RequestPath, tokenizer: Any, *, incremental_streaming: bool) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.incremental_streaming = incremental_streaming

    async def generate(self, request: web.Request) -> web.StreamResponse:
        cap = self.path.limits.max_batch_requests
        parsed = await self.path.parsed(request, lambda data: parse_generate(data, cap))
        rids = self.path.rids(parsed.items)
        started = time.monotonic()
        gens = [
            self.path.events(one, rid, stream=parsed.stream)
            for one, rid in zip(parsed.items, rids, strict=True)
        ]
        async with contextlib.AsyncExitStack() as closing:
            for gen in gens:
                closing.push_async_callback(gen.aclose)  # type: ignore[attr-defined]
            if parsed.stream:
                return await self._stream(request, parsed.items, rids, gens, parsed.batch, started)
            results = await self.path.results(gens)
            outs = [
                {
                    "text": result.text,
                    "output_ids": result.output_ids,
                    "meta_info": self._meta(one, rid, result.meta_info, started),
                }
                for one, rid, result in zip(parsed.items, rids, results, strict=True)
            ]
            return web.json_response(outs if parsed.batch else outs[0])

    def _meta(
        self, one: GenerateOne, rid: str, meta_info: dict[str, Any], started: float
    ) -> dict[str, Any]:
        # The scheduler's meta_info, with SGLang's id, and the latency the client sees.
        meta = {**meta_info, "id": rid, "e2e_latency": time.monotonic() - started}
        return with_logprob_text(meta, self.tokenizer) if one.return_text_in_logprobs else meta

    async def _stream(
        self,
        request: web.Request,
        ones: Sequence[GenerateOne],
        rids: Sequence[str],
        gens: Sequence[AsyncIterator[Item]],
        batch: bool,
        started: float,
    ) -> web.StreamResponse:
        firsts = await self.path.firsts(gens)
        response = await open_stream(request)
        incremental = self.incremental_streaming
        texts = [stream_text(self.tokenizer, one, incremental=incremental) for one in ones]
        metas = [StreamMeta(rid, incremental=incremental) for rid in rids]
        try:
            async with contextlib.aclosing(self.path.merged(gens, firsts)) as merged:
                async for i, item in merged:
                    if isinstance(item, Chunk):
                        payload = texts[i].chunk(item.token_ids)
                        meta = metas[i].chunk(
                            getattr(item, "meta_info", None), item.offset + len(item.token_ids)
                        )
                    else:
                        payload = texts[i].done(item)
                        meta = metas[i].done(item.meta_info)
                        meta["e2e_latency"] = time.monotonic() - started
                    if ones[i].return_text_in_logprobs:
                        meta = with_logprob_text(meta, self.tokenizer)
                    payload["meta_info"] = meta
                    if batch:
                        payload["index"] = i
                    await response.write(sse(payload))
        except ApiError as exc:  # the status line is sent: report in the stream
            await response.write(sse({"error": {"message": exc.message, "code": exc.code}}))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response
