"""Storage faults for the hierarchical cache's tests: damaged page files and a backend
that fails its writes on demand (a full disk), both seeded by the caller."""

from __future__ import annotations

import errno
import os

from memsvc.core.storage import StorageBackend
from memsvc.core.storage.file import FileStorage

# What can happen to a page file behind memsvc's back (issue 26, items 1-3).
DAMAGE_KINDS = ("delete", "truncate", "corrupt", "zero", "swap", "symlink")


def damage_file(path: str, kind: str, other: str, offset: int = 0) -> None:
    """Damage the page file ``path``; ``other`` is another page file (for ``swap`` and
    ``symlink``: a whole, valid page, but not this one); ``offset`` picks the byte that
    ``corrupt`` flips."""
    if os.path.islink(path):  # damaged before: a link stays a link, the rest is moot
        kind = "delete"
    size = os.lstat(path).st_size
    if kind == "delete":
        os.unlink(path)
    elif kind == "truncate":
        os.truncate(path, size // 2)
    elif kind == "corrupt":
        with open(path, "r+b") as f:
            f.seek(offset % size)
            byte = f.read(1)
            f.seek(offset % size)
            f.write(bytes([byte[0] ^ 0x10]))
    elif kind == "zero":
        with open(path, "r+b") as f:
            f.write(bytes(size))
    elif kind == "swap" and other != path:
        with open(other, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data)
    elif kind == "symlink":
        os.unlink(path)
        os.symlink(other if other != path else path + ".gone", path)
    elif kind != "swap":
        raise ValueError(f"unknown damage {kind!r}")


class FullDiskStorage(StorageBackend):
    """A backend over a :class:`FileStorage` whose writes fail with ENOSPC while
    ``full`` is set: the shared layer (seal, verify) is the real one."""

    def __init__(self, inner: FileStorage) -> None:
        self.inner = inner
        self.name = inner.name
        self.page_bytes = inner.page_bytes
        self.directory = inner.directory
        self.full = False
        self.failed_writes = 0

    def _write(self, key, data, trailer) -> None:
        if self.full:
            self.failed_writes += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self.inner._write(key, data, trailer)

    def _read(self, key, data, trailer):
        return self.inner._read(key, data, trailer)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self) -> set[str]:
        return self.inner.keys()

    def close(self) -> None:
        self.inner.close()
