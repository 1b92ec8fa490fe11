"""A request's body, as the front takes it: read within the limits, decoded as JSON.

The front reads a body only up to ``--max-request-body-bytes`` and within
``--http-body-timeout`` (:func:`read_body`), refuses JSON that holds NaN or an
infinity (:func:`decode_json`), and caps the scheduler requests one body may
become (:func:`check_batch`). Validating the decoded body is each endpoint
family's own (:mod:`kvstack.serve.sglang.protocol`,
:mod:`kvstack.serve.openai.protocol`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from kvstack.serve.connections import ConnectionGuard
from kvstack.serve.errors import ApiError
from kvstack.serve.limits import FrontLimits


async def read_body(
    request: web.Request, limits: FrontLimits, connections: ConnectionGuard
) -> bytes:
    """The body: 413 past ``--max-request-body-bytes`` (by its Content-Length, before
    reading it), 408 if it does not arrive within ``--http-body-timeout``."""
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise too_large(request.content_length, limits.max_body_bytes)
    try:
        with connections.receiving(request.transport):
            return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            "body_timeout",
            f"the body did not arrive within {limits.body_timeout_s:g} s (--http-body-timeout)",
        ) from None
    except web.HTTPRequestEntityTooLarge:  # a chunked body, past the cap as it came
        raise too_large(None, limits.max_body_bytes) from None


def too_large(size: int | None, cap: int) -> ApiError:
    got = f"{size} bytes" if size is not None else "more"
    return ApiError(
        413,
        "body_too_large",
        f"the body is {got}; this server takes at most {cap} bytes (--max-request-body-bytes)",
    )


def decode_json(body: bytes) -> Any:
    """The body as JSON; :class:`ApiError` 400 if it is not JSON, or holds NaN or an
    infinity (which Python's json accepts and JSON does not)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "malformed_json", "the body nests too deeply to parse") from None
    where = find_non_finite(data)
    if where is not None:
        raise ApiError(
            400,
            "invalid_request",
            f"{where}: NaN and Infinity are not valid JSON numbers",
            param=where,
        )
    return data


def check_batch(num_prompts: int, n: int, max_requests: int, param: str | None = None) -> None:
    """:class:`ApiError` 400 naming the cap if ``num_prompts`` prompts, each sampled ``n``
    times, would be more than ``max_requests`` scheduler requests."""
    if num_prompts * n <= max_requests:
        return
    shape = f"{num_prompts} prompts" + (f" × n {n}" if n > 1 else "")
    raise ApiError(
        400,
        "batch_too_large",
        f"{param + ': ' if param else ''}this request would be {num_prompts * n} scheduler "
        f"requests ({shape}); a request may be at most {max_requests} "
        "(--max-batch-requests)",
        param=param,
    )


def find_non_finite(data: Any) -> str | None:
    """The path of the first NaN or infinity in parsed JSON (``a.b[2]``), or None.

    One pass that allocates nothing per value: a stack of the open containers'
    iterators and of the keys that led into them; a path is built only for the
    value found. A list with no float or container in it (a prompt's ids) is
    passed over at C speed.
    """
    if not isinstance(data, (dict, list)):
        bad = isinstance(data, float) and not math.isfinite(data)
        return "(the body)" if bad else None
    if _plain(data):
        return None
    keys: list[Any] = []  # keys[i]: where in frames[i] frames[i + 1] is
    frames: list[Iterator[tuple[Any, Any]]] = [_entries(data)]
    while frames:
        for key, value in frames[-1]:
            if isinstance(value, float):
                if not math.isfinite(value):
                    return _path([*keys, key])
            elif isinstance(value, (dict, list)) and not _plain(value):
                keys.append(key)
                frames.append(_entries(value))
                break
        else:  # this container is done
            frames.pop()
            if keys:
                keys.pop()
    return None


_WALKED = frozenset({float, dict, list})  # json.loads makes exactly these types


def _plain(container: dict[str, Any] | list[Any]) -> bool:
    """A list holding nothing to look into (no float, no container)."""
    return isinstance(container, list) and _WALKED.isdisjoint(map(type, container))


def _entries(container: dict[str, Any] | list[Any]) -> Iterator[tuple[Any, Any]]:
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


def _path(keys: list[Any]) -> str:
    """``a.b[2]`` from ``["a", "b", 2]``: list indices are ints, object keys strings."""
    out = ""
    for key in keys:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            out += f".{key}" if out else str(key)
    return out
