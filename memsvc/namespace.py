"""Cache namespaces: which requests may share cached KV.

Two requests share KV (in every tier) only if their ``cache_salt`` and ``extra_key``
are equal. The scheduler turns the pair into a *namespace*: ``""`` for a request with
neither (the default namespace), else a 32-hex-digit digest. memsvc only ever sees the
digest, never the salt, so a namespace is also safe to use as a (shortened) metric
label or in a storage key.
"""

from __future__ import annotations

import hashlib
import re

DEFAULT_NAMESPACE = ""
NAMESPACE_PATTERN = r"^(|[0-9a-f]{32})$"
_NAMESPACE_RE = re.compile(NAMESPACE_PATTERN)


def namespace_of(cache_salt: str | None, extra_key: str | None) -> str:
    """The namespace of a request with this ``cache_salt`` and ``extra_key``."""
    if cache_salt is None and extra_key is None:
        return DEFAULT_NAMESPACE
    digest = hashlib.blake2b(digest_size=16, person=b"kvstack-ns")
    for part in (cache_salt, extra_key):
        # None and "" differ, and the boundary between the two parts is unambiguous.
        encoded = b"" if part is None else part.encode()
        digest.update(b"-" if part is None else b"+%d:" % len(encoded))
        digest.update(encoded)
    return digest.hexdigest()


def is_namespace(value: object) -> bool:
    return isinstance(value, str) and _NAMESPACE_RE.match(value) is not None


def namespace_label(namespace: str) -> str:
    """A short metric label: ``"default"`` or the digest's first 12 hex digits."""
    return "default" if namespace == DEFAULT_NAMESPACE else namespace[:12]
