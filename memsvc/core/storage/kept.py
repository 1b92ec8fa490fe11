"""The pages a kept storage tier holds that the tree has not met yet (``--hicache-storage-keep``).

The tree finds storage pages through its nodes; after a restart it has none, so
the kept directory's page names are its index: a match that runs past the tree
continues the prefix's hash chain (:func:`~memsvc.core.storage.chain.page_hash_chain`,
seeded by the namespace's :meth:`~memsvc.core.identity.KVIdentity.storage_seed`)
page by page while each key is kept, and the tree adopts that run as a
storage-only node (it leaves this index then). A kept page of another model,
dtype, layout, page size or namespace has another key: it is never looked up,
and goes, oldest first, when the tier needs room. A page found is still
verified when it is read (its checksum covers its key and its bytes).

A shared tier (``StorageBackend.shared``: Mooncake Store, every node on one master)
is found the same way, its index being the store itself: :func:`shared_run` asks it
for the next pages' keys in one round trip (``exists``), and the run up to the first
miss is adopted alike. So node B finds what node A wrote, under A's own keys: equal
tokens, model, dtype, layout, page size and namespace, equal chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.storage.chain import page_hash_chain

if TYPE_CHECKING:
    from memsvc.core.storage.base import StorageBackend


class KeptPages:
    """Keys of kept pages no tree node holds, oldest first (a dict keeps the order)."""

    def __init__(self, keys: list[str] = ()) -> None:
        self._keys: dict[str, None] = dict.fromkeys(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> set[str]:
        return set(self._keys)

    def run(self, prev: str, tokens: np.ndarray, page_size: int) -> list[str]:
        """The keys of ``tokens``' whole pages after the key ``prev`` (a node's last key,
        or a namespace's seed), as far as each is kept; ``[]`` at once when none is."""
        out: list[str] = []
        if not self._keys:
            return out
        for start in range(0, len(tokens) - page_size + 1, page_size):
            (prev,) = page_hash_chain(prev, tokens[start : start + page_size], page_size)
            if prev not in self._keys:
                break
            out.append(prev)
        return out

    def take(self, keys: list[str]) -> None:
        """``keys`` leave the index (a node holds them now, or they are rewritten)."""
        for key in keys:
            self._keys.pop(key, None)

    def oldest(self, num: int) -> list[str]:
        """Take the ``num`` oldest keys out (to delete their pages)."""
        out = []
        for key in self._keys:
            if len(out) >= num:
                break
            out.append(key)
        self.take(out)
        return out

    def clear(self) -> list[str]:
        out = list(self._keys)
        self._keys.clear()
        return out


def shared_run(
    storage: StorageBackend, prev: str, tokens: np.ndarray, page_size: int, limit: int
) -> list[str]:
    """The keys of ``tokens``' first whole pages (at most ``limit``) after the key
    ``prev`` that the shared ``storage`` holds, up to the first it does not: one
    ``exists`` round trip; ``[]`` without one when not a whole page is left."""
    num_pages = min(len(tokens) // page_size, limit)
    if num_pages <= 0:
        return []
    keys = page_hash_chain(prev, tokens[: num_pages * page_size], page_size)
    found = storage.exists(keys)
    num = 0
    while num < num_pages and found[num]:
        num += 1
    return keys[:num]
