"""``GET /v1/models`` and ``/v1/models/{model}``: the one model served, as SGLang's card.

``model`` in a request body is accepted whatever it names, as SGLang accepts
it; these endpoints name the served model (``--served-model-name``, else the
model path) with the scheduler's context length.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from kvstack.serve.errors import ApiError
from kvstack.serve.request_path import RequestPath


class OpenAIServingModels:
    """The ``/v1/models`` endpoints over the shared request path."""

    def __init__(self, path: RequestPath, served_model_name: str) -> None:
        self.path = path
        self.served_model_name = served_model_name

    async def list_models(self, request: web.Request) -> web.Response:
        card = model_card(self.served_model_name, await self._context_len_or_none())
        return web.json_response({"object": "list", "data": [card]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model != self.served_model_name:
            raise ApiError(404, "model_not_found", f"The model '{model}' does not exist", "model")
        return web.json_response(
            model_card(self.served_model_name, await self._context_len_or_none())
        )

    async def _context_len_or_none(self) -> int | None:
        try:
            return await self.path.context_len()
        except ApiError:
            return None


def model_card(name: str, max_model_len: int | None) -> dict[str, Any]:
    """SGLang's ``ModelCard``."""
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
    }
