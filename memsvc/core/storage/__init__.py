"""The storage tier of the hierarchical cache: page blocks keyed by a prefix hash.

The interface (:class:`StorageBackend`) is four calls on whole KV pages, so a
Mooncake or LMCache store can plug in later::

    put(key, page)        exists(key)        get(key, out) -> bool        delete(key)

``key`` is the hash of the token ids from the root to the end of that page
(:func:`memsvc.core.hicache.page_hash_chain`); ``page`` one pool page,
``[layers, 2, page_size, heads, dim]``. The tree keeps its own index of the
keys it stored (and their bytes), so a backend needs no listing.

Restart: the tree that indexes a store dies with memsvc, so a backend is
opened with :meth:`StorageBackend.discard_all`: the pages a previous memsvc
left are deleted, never half-trusted.
"""

from __future__ import annotations

from memsvc.core.storage.base import StorageBackend
from memsvc.core.storage.file import FileStorage

STORAGE_BACKENDS = ("file", "nixl")


def create_storage(name: str, directory: str, page_bytes: int) -> StorageBackend:
    """The storage backend ``name`` over ``directory`` (created if missing)."""
    if name == "file":
        return FileStorage(directory, page_bytes)
    if name == "nixl":
        from memsvc.core.storage.nixl import NixlStorage

        return NixlStorage(directory, page_bytes)
    raise ValueError(f"unknown storage backend {name!r}; choose from {STORAGE_BACKENDS}")


__all__ = ["STORAGE_BACKENDS", "FileStorage", "StorageBackend", "create_storage"]
