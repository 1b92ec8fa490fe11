"""The storage backend interface (see :mod:`memsvc.core.storage`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class StorageBackend(ABC):
    """Whole KV pages by key. Called from memsvc's copy thread only, in issue order."""

    name: str

    @abstractmethod
    def put(self, key: str, page: np.ndarray) -> None:
        """Store one page (overwrites); raises ``OSError`` when it cannot."""

    @abstractmethod
    def get(self, key: str, out: np.ndarray) -> bool:
        """Read one page into ``out``; ``False`` if the key is absent or incomplete."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove a page; a missing key is not an error."""

    @abstractmethod
    def keys(self) -> set[str]:
        """Every key stored (for the integrity check and for discarding)."""

    def discard_all(self) -> int:
        """Delete every page stored; returns how many."""
        keys = self.keys()
        for key in keys:
            self.delete(key)
        return len(keys)

    def close(self) -> None:
        return None
