"""A directory of page files: ``<dir>/<key>.kvpage``, one pool page each."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from memsvc.core.storage.base import StorageBackend

SUFFIX = ".kvpage"


class FileStorage(StorageBackend):
    name = "file"

    def __init__(self, directory: str, page_bytes: int) -> None:
        self.directory = os.path.abspath(directory)
        self.page_bytes = page_bytes
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key + SUFFIX)

    def put(self, key: str, page: np.ndarray) -> None:
        # Written under a temporary name and renamed: a page file is whole or absent.
        path = self._path(key)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(np.ascontiguousarray(page).view(np.uint8).reshape(-1).data)
        os.replace(tmp, path)

    def get(self, key: str, out: np.ndarray) -> bool:
        view = out.view(np.uint8).reshape(-1)
        try:
            with open(self._path(key), "rb") as f:
                n = f.readinto(view.data)
        except FileNotFoundError:
            return False
        return n == self.page_bytes

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def keys(self) -> set[str]:
        names = os.listdir(self.directory)
        return {n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX)}

    def discard_all(self) -> int:
        for name in os.listdir(self.directory):
            if name.endswith(SUFFIX + ".tmp"):
                os.unlink(os.path.join(self.directory, name))
        return super().discard_all()
