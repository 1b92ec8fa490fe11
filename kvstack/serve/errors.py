"""The front's error replies: :class:`ApiError` and the two shapes it is answered in.

SGLang's native endpoints answer ``{"error": {"message", "code"}}``; under
``/v1/`` the answer is OpenAI's error object, as SGLang's OpenAI server
answers it (:func:`openai_error_body`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import ValidationError


class ApiError(Exception):
    """Answered as ``{"error": {"message", "code"}}`` with HTTP status ``status`` (under
    ``/v1/``, OpenAI's error object: :func:`openai_error_body`)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


OPENAI_ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object as SGLang's OpenAI server answers it."""
    return {
        "object": "error",
        "message": message,
        "type": OPENAI_ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "Error"),
        "param": param,
        "code": status,
    }


def validation_message(exc: ValidationError, prefix: str = "") -> str:
    """Every error of ``exc``, each after where it is (``prefix`` first): ``a.b: msg; ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        where = prefix + ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)


def http_status(status_code: int) -> int:
    """The scheduler's status for a rejection, as an HTTP error status."""
    return status_code if 400 <= status_code <= 599 else 500
