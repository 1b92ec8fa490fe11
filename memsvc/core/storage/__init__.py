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
With ``--hicache-storage-keep`` the subdirectory outlives memsvc, and the next
one finds a kept page through the page's key alone (:mod:`memsvc.core.storage.kept`):
a key names the model, dtype, layout, page size, namespace and token prefix
(:mod:`memsvc.core.identity`), and the page's checksum covers that key.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from memsvc.core.storage.base import StorageBackend
from memsvc.core.storage.file import FileStorage
from memsvc.core.storage.tierdir import StorageDir, default_storage_base

if TYPE_CHECKING:
    from memsvc.core.hicache_config import HiCacheConfig


class StorageBackendName(StrEnum):
    """``--hicache-storage-backend``: one name per entry of :data:`STORAGE_BACKENDS`."""

    FILE = "file"  # a local directory
    NIXL = "nixl"  # NIXL's POSIX storage plugin on the same directory
    MOONCAKE = "mooncake"  # a Mooncake Store, shared by every node on its master


def _own_dir(config: HiCacheConfig, make: Callable[[StorageDir], StorageBackend]):
    """``make`` in a new private subdirectory of ``config.storage_dir`` (``None``:
    :func:`default_storage_base`), named after ``config.storage_role``; with
    ``config.storage_keep`` the role's kept subdirectory, pages and all."""
    directory = StorageDir(config.storage_dir, config.storage_role, keep=config.storage_keep)
    try:
        return make(directory)
    except BaseException:
        directory.close([])
        raise


def _file(config: HiCacheConfig, page_bytes: int) -> StorageBackend:
    return _own_dir(config, lambda directory: FileStorage(directory, page_bytes))


def _nixl(config: HiCacheConfig, page_bytes: int) -> StorageBackend:
    from memsvc.core.storage.nixl import NixlStorage  # imports nixl only when chosen

    return _own_dir(config, lambda directory: NixlStorage(directory, page_bytes))


def _mooncake(config: HiCacheConfig, page_bytes: int) -> StorageBackend:
    from memsvc.core.storage.mooncake import MooncakeConfig, MooncakeStorage  # mooncake lazily

    return MooncakeStorage(MooncakeConfig.load(config.storage_extra_config), page_bytes)


# The registry: a new backend is its module and one name and one line here.
STORAGE_BACKENDS: dict[StorageBackendName, Callable[[HiCacheConfig, int], StorageBackend]] = {
    StorageBackendName.FILE: _file,
    StorageBackendName.NIXL: _nixl,
    StorageBackendName.MOONCAKE: _mooncake,
}


def create_storage(config: HiCacheConfig, page_bytes: int) -> StorageBackend:
    """``config.storage_backend`` for pages of ``page_bytes``."""
    make = STORAGE_BACKENDS.get(config.storage_backend)  # type: ignore[arg-type]
    if make is None:
        raise ValueError(
            f"unknown storage backend {config.storage_backend!r}; "
            f"choose from {tuple(b.value for b in StorageBackendName)}"
        )
    return make(config, page_bytes)


__all__ = [
    "STORAGE_BACKENDS",
    "FileStorage",
    "StorageBackend",
    "StorageBackendName",
    "StorageDir",
    "create_storage",
    "default_storage_base",
]
