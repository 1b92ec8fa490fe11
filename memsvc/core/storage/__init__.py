"""The storage tier of the hierarchical cache: sealed page records keyed by a prefix hash.

The interface (:class:`StorageBackend`) is four calls on whole KV pages, so a
Mooncake or LMCache store can plug in later::

    put(key, page)        get(key, out) -> None | why not        delete(key)        keys()

``key`` is the hash of the token ids from the root to the end of that page
(:func:`memsvc.core.hicache.page_hash_chain`); ``page`` one pool page,
``[layers, 2, page_size, heads, dim]``. ``put`` seals a page with a checksum over
its bytes and its key, and ``get`` verifies it before anyone uses it
(:mod:`memsvc.core.storage.base`): a backend only moves records. The tree keeps
its own index of the keys it stored, so a backend needs no listing but for the
integrity check.

Where: each memsvc has a private subdirectory of its own under the storage base
(:mod:`memsvc.core.storage.tierdir`), so nothing a previous memsvc or another
stack left is ever read; the tree that indexed a store dies with its memsvc.
"""

from __future__ import annotations

from memsvc.core.storage.base import StorageBackend
from memsvc.core.storage.file import FileStorage
from memsvc.core.storage.tierdir import StorageDir, default_storage_base

STORAGE_BACKENDS = ("file", "nixl")


def create_storage(
    name: str, base: str | None, page_bytes: int, *, role: str = "normal"
) -> StorageBackend:
    """The storage backend ``name`` in a new private subdirectory of ``base``
    (``None``: :func:`default_storage_base`)."""
    if name not in STORAGE_BACKENDS:
        raise ValueError(f"unknown storage backend {name!r}; choose from {STORAGE_BACKENDS}")
    directory = StorageDir(base, role)
    try:
        if name == "nixl":
            from memsvc.core.storage.nixl import NixlStorage

            return NixlStorage(directory, page_bytes)
        return FileStorage(directory, page_bytes)
    except BaseException:
        directory.close([])
        raise


__all__ = [
    "STORAGE_BACKENDS",
    "FileStorage",
    "StorageBackend",
    "StorageDir",
    "create_storage",
    "default_storage_base",
]
