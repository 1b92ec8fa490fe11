"""The storage backend interface, and the sealed page record every backend stores.

A record is one pool page followed by a trailer that seals it::

    | page (page_bytes) | magic (8) | page_bytes (8, LE) | blake2b-128(key, page) (16) |

:meth:`StorageBackend.put` seals a page and :meth:`StorageBackend.get` verifies it
before anyone uses it. The digest covers the page's key (its identity: the hash
chain of its tokens) as well as its bytes, so a whole, valid page stored under
another name (a swapped or linked file) fails like a flipped bit, a zeroed or a
short file. Backends only move records (:meth:`StorageBackend._write`,
:meth:`StorageBackend._read`); the checks live here, once, for every backend.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod

import numpy as np

MAGIC = b"kvpage\x00\x01"
TRAILER = struct.Struct("<8sQ16s")
_HEX = frozenset("0123456789abcdef")


def page_digest(key: str, data: memoryview) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(key.encode())
    digest.update(b"\0")
    digest.update(data)
    return digest.digest()


def _checked_key(key: str) -> str:
    # Keys name files: only the hex digests the tree makes, never a path.
    if not key or len(key) > 64 or not _HEX.issuperset(key):
        raise ValueError(f"bad storage key {key!r}")
    return key


class StorageBackend(ABC):
    """Whole KV pages by key. Called from memsvc's copy thread only, in issue order
    (:meth:`keys` and :meth:`close` once every copy has settled)."""

    name: str
    page_bytes: int
    # Other nodes read and write the same pages (mooncake): a match that runs out of
    # tree asks the store for the next pages' keys (``exists``), and a node's delete or
    # close only forgets its own index, never removes what others may be using.
    shared: bool = False

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the store holds a record under each key (a shared backend's)."""
        raise NotImplementedError(f"{self.name} is not a shared tier")

    @property
    def record_bytes(self) -> int:
        return self.page_bytes + TRAILER.size

    def put(self, key: str, page: np.ndarray) -> None:
        """Store one page, sealed (replacing any); raises ``OSError`` when it cannot,
        leaving nothing half-written under the key."""
        data = memoryview(np.ascontiguousarray(page).view(np.uint8).reshape(-1))
        if data.nbytes != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {data.nbytes}")
        trailer = TRAILER.pack(MAGIC, self.page_bytes, page_digest(key, data))
        self._write(_checked_key(key), data, trailer)

    def get(self, key: str, out: np.ndarray) -> str | None:
        """Read one page into ``out`` (contiguous) and verify it.

        ``None`` when ``out`` holds the page that was put under ``key``; else why
        not (missing, short, corrupt, unreadable: ``out`` is then garbage). Never
        raises for what it finds on the storage.
        """
        data = memoryview(out.view(np.uint8).reshape(-1))
        trailer = bytearray(TRAILER.size)
        try:
            why = self._read(_checked_key(key), data, trailer)
        except OSError as exc:
            why = f"unreadable ({exc.strerror or exc})"
        if why is not None:
            return why
        magic, size, digest = TRAILER.unpack(trailer)
        if magic != MAGIC or size != self.page_bytes:
            return "not a sealed page"
        if digest != page_digest(key, data):
            return "checksum mismatch"
        return None

    @abstractmethod
    def _write(self, key: str, data: memoryview, trailer: bytes) -> None:
        """Store the record ``data + trailer`` under ``key``, whole or not at all."""

    @abstractmethod
    def _read(self, key: str, data: memoryview, trailer: bytearray) -> str | None:
        """Fill ``data`` and ``trailer`` from ``key``'s record: ``None``, or why not."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove a page; a missing key is not an error."""

    @abstractmethod
    def keys(self) -> set[str]:
        """Every key stored (for the integrity check)."""

    def keys_oldest_first(self) -> list[str]:
        """Every key stored, least recently written first where the backend knows (a kept
        tier's index, :mod:`memsvc.core.storage.kept`)."""
        return sorted(self.keys())

    def close(self) -> None:
        return None
