"""Page files in this memsvc's own directory: ``<dir>/<key>.kvpage``, one sealed page each.

Every call names files relative to the directory's descriptor
(:class:`~memsvc.core.storage.tierdir.StorageDir`) and never follows a link: a
page is written to ``<key>.kvpage.tmp``, created ``O_EXCL | O_NOFOLLOW`` with
mode 0600, and renamed over ``<key>.kvpage``; a write that fails removes the
``.tmp`` it created (and a ``.tmp`` it did not create fails the write, untouched).
A read opens ``O_NOFOLLOW | O_NONBLOCK`` and takes only a regular file of the
record's exact size.
"""

from __future__ import annotations

import contextlib
import os
import stat

from memsvc.core.storage.base import StorageBackend
from memsvc.core.storage.tierdir import SUFFIX, StorageDir

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")


def write_all(fd: int, buffers: list[memoryview | bytes]) -> None:
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            view = view[os.write(fd, view) :]


def read_all(fd: int, buffers: list[memoryview | bytearray]) -> int:
    """Fill ``buffers`` from ``fd``; returns the bytes read (less at end of file)."""
    total = 0
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            n = os.readv(fd, [view])
            if n == 0:
                return total
            total += n
            view = view[n:]
    return total


def _is_key(name: str) -> bool:
    return 0 < len(name) <= 64 and _HEX.issuperset(name)


class FileStorage(StorageBackend):
    name = "file"

    def __init__(self, directory: StorageDir, page_bytes: int) -> None:
        self.dir = directory
        self.directory = directory.path
        self.page_bytes = page_bytes
        self._fd = directory.fd
        self._written: set[str] = set()  # keys whose file this memsvc made and still has

    def _write(self, key: str, data: memoryview, trailer: bytes) -> None:
        tmp = key + SUFFIX + ".tmp"
        fd = os.open(tmp, _CREATE, 0o600, dir_fd=self._fd)  # EEXIST: not ours, left alone
        try:
            try:
                self._write_record(fd, key, data, trailer)
            finally:
                os.close(fd)
            os.replace(tmp, key + SUFFIX, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)
            raise
        self._written.add(key)

    def _write_record(self, fd: int, key: str, data: memoryview, trailer: bytes) -> None:
        write_all(fd, [data, trailer])

    def _open(self, key: str) -> tuple[int | None, str | None]:
        """A descriptor of ``key``'s record if it is a regular file of the right size."""
        try:
            fd = os.open(key + SUFFIX, _OPEN, dir_fd=self._fd)
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:  # ELOOP: a link where the page was
            return None, f"unreadable ({exc.strerror or exc})"
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_size != self.record_bytes:
            why = f"{st.st_size} bytes, not {self.record_bytes}"
        if why is not None:
            os.close(fd)
            return None, why
        return fd, None

    def _read(self, key: str, data: memoryview, trailer: bytearray) -> str | None:
        fd, why = self._open(key)
        if fd is None:
            return why
        try:
            return self._read_record(fd, key, data, trailer)
        finally:
            os.close(fd)

    def _read_record(self, fd: int, key: str, data: memoryview, trailer: bytearray) -> str | None:
        if read_all(fd, [data, trailer]) != self.record_bytes:
            return "short read"
        return None

    def delete(self, key: str) -> None:
        try:
            os.unlink(key + SUFFIX, dir_fd=self._fd)
        except FileNotFoundError:
            pass
        except OSError:
            return  # not a file we can remove (a directory planted there): keep the name
        self._written.discard(key)

    def keys(self) -> set[str]:
        return {n[: -len(SUFFIX)] for n in os.listdir(self._fd) if n.endswith(SUFFIX)}

    def keys_oldest_first(self) -> list[str]:
        aged = []
        for name in os.listdir(self._fd):
            key = name[: -len(SUFFIX)]
            if not name.endswith(SUFFIX) or not _is_key(key):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    aged.append((st.st_mtime_ns, key))
        return [key for _, key in sorted(aged)]

    def close(self) -> None:
        self.dir.close([key + SUFFIX for key in self._written])
