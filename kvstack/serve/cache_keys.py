"""``cache_salt`` and ``extra_key``: which requests may share cached KV, as SGLang reads them.

Two requests share cached KV (in every tier) only if their ``cache_salt`` and
``extra_key`` are equal; the scheduler turns the pair into a namespace
(:func:`memsvc.namespace.namespace_of`). The front checks the two fields with
SGLang 0.5.23's rules (``GenerateReqInput._normalize_single_inputs`` /
``_normalize_extra_key`` / ``_normalize_cache_salt``, and the OpenAI server's
``_compute_extra_key``):

- one prompt: each is a string or null; anything else is refused;
- a batch: a string (the same for every prompt) or a list of strings, one per
  prompt (a list of another length, or with a member that is not a string, is
  refused); parallel samples (``n``) share their prompt's;
- the empty string means "none", as null does.

kvstack caps each at :data:`MAX_KEY_LEN` characters (SGLang has no cap).
"""

from __future__ import annotations

from typing import Any

from kvstack.serve.errors import ApiError
from scheduler_svc.protocol import MAX_CACHE_KEY_LEN as MAX_KEY_LEN

KEY_FIELDS = ("cache_salt", "extra_key")


def _checked(name: str, value: str) -> str | None:
    if len(value) > MAX_KEY_LEN:
        raise ApiError(
            400,
            "invalid_request",
            f"{name}: at most {MAX_KEY_LEN} characters, got {len(value)}",
            param=name,
        )
    return value or None  # SGLang: "" is unset


def single_key(name: str, value: Any) -> str | None:
    """One prompt's ``name`` field (SGLang's ``_normalize_single_inputs``)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(
            400, "invalid_request", f"{name} should be a string for a single request.", param=name
        )
    return _checked(name, value)


def batch_keys(name: str, value: Any, size: int) -> list[str | None]:
    """Each of a batch's ``size`` prompts' ``name`` field (SGLang's ``_normalize_<name>``)."""
    if value is None:
        return [None] * size
    if isinstance(value, str):
        return [_checked(name, value)] * size
    if not isinstance(value, list):
        raise ApiError(400, "invalid_request", f"{name} should be a list or a string.", param=name)
    if len(value) != size:
        raise ApiError(
            400,
            "invalid_request",
            f"The length of {name} should be equal to the batch size.",
            param=name,
        )
    if any(not isinstance(v, str) for v in value):
        raise ApiError(400, "invalid_request", f"Every {name} should be a string.", param=name)
    return [_checked(name, v) for v in value]


def split_keys(fields: dict[str, Any], size: int | None) -> list[dict[str, str | None]]:
    """Per prompt, its ``cache_salt`` and ``extra_key`` (``size`` None: one prompt)."""
    if size is None:
        return [{name: single_key(name, fields.get(name)) for name in KEY_FIELDS}]
    columns = {name: batch_keys(name, fields.get(name), size) for name in KEY_FIELDS}
    return [{name: columns[name][i] for name in KEY_FIELDS} for i in range(size)]
