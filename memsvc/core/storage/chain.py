"""Storage keys: the hash chain that names a prefix's pages, from a seed (the KV identity
and namespace, :mod:`memsvc.core.identity`) through each page's token ids."""

from __future__ import annotations

import hashlib

import numpy as np


def page_hash_chain(prev: str, tokens: np.ndarray, page_size: int) -> list[str]:
    """Storage keys of consecutive pages: each hashes the previous key and its page's tokens."""
    out = []
    for start in range(0, len(tokens), page_size):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(prev.encode())
        digest.update(np.ascontiguousarray(tokens[start : start + page_size]).tobytes())
        prev = digest.hexdigest()
        out.append(prev)
    return out
