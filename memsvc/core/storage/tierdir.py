"""The storage tier's directory: one private subdirectory per memsvc::

    <base>/                      owned by us, not group- or world-writable
      normal-4242-1a2b3c4d/      <role>-<pid>-<random>: made by this memsvc, 0700,
        <key>.kvpage             flock'ed while it runs; pages 0600, created
                                 O_EXCL | O_NOFOLLOW

``base`` is ``--hicache-storage-dir``, by default per user
(:func:`default_storage_base`). With ``--hicache-storage-keep`` the
subdirectory is ``kept-<role>`` instead: the same on every start, flock'ed
while a memsvc runs (a second one on it is refused), its pages left in place
at close for the next memsvc of that role (:mod:`memsvc.core.storage.kept`);
only ``.tmp`` files a write left are removed at start. Every file operation goes through the
subdirectory's descriptor, so no path is resolved twice and no link is
followed. Two memsvc on one base (the PD nodes, two stacks) never share a
subdirectory. A clean close deletes the pages this memsvc wrote and its
subdirectory. A subdirectory left by a memsvc that died (its name ours, its
lock free) is removed by the next one on the same base: its page files and
``.tmp`` files only, then the directory if nothing else is in it. A locked one
is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable

from memsvc.core.errors import InvalidArgumentError

log = logging.getLogger("memsvc")

SUFFIX = ".kvpage"
_SUBDIR = re.compile(r"[a-z]+-\d+-[0-9a-f]{8}")
_OUR_FILE = re.compile(r"[0-9a-f]{1,64}\.kvpage(\.tmp)?")
_OUR_TMP = re.compile(r"[0-9a-f]{1,64}\.kvpage\.tmp")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def default_storage_base() -> str:
    """``$XDG_CACHE_HOME/kvstack/hicache``, else ``~/.cache/kvstack/hicache``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvstack", "hicache")


def _unusable(path: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"hicache storage directory {path!r} is unusable: {why}")


def _check_private(path: str, fd: int, *, exact: bool = False) -> None:
    """Refuse a directory that is not ours, or that others may write (``exact``: 0700)."""
    st = os.fstat(fd)
    uid = os.geteuid()
    if st.st_uid != uid:
        raise _unusable(
            path, f"it is not owned by you (uid {st.st_uid} owns it, memsvc runs as {uid})"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & (0o077 if exact else 0o022):
        raise _unusable(
            path,
            f"it is writable by others (mode {mode:04o}): anyone could plant, read or delete "
            "pages there; `chmod go-w` it or choose another",
        )


def _open_base(path: str) -> int:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise _unusable(path, str(exc)) from exc
    try:
        _check_private(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_names(dir_fd: int, names: Iterable[str]) -> None:
    for name in names:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("hicache storage: could not delete %s: %s", name, exc)


class StorageDir:
    """This memsvc's subdirectory under ``base`` (see the module docstring)."""

    def __init__(self, base: str | None, role: str = "normal", *, keep: bool = False) -> None:
        if not re.fullmatch(r"[a-z]+", role):
            raise InvalidArgumentError(f"bad hicache storage role {role!r}")
        self.base = os.path.abspath(base or default_storage_base())
        self.keep = keep
        self._base_fd = _open_base(self.base)
        self.fd = -1
        self.name = f"kept-{role}" if keep else f"{role}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = os.path.join(self.base, self.name)
        made = False
        try:
            self._reclaim_dead()
            try:
                os.mkdir(self.name, 0o700, dir_fd=self._base_fd)
                made = True
            except FileExistsError:
                if not keep:
                    raise
            self.fd = os.open(self.name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self._base_fd)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _unusable(
                    self.path,
                    "another memsvc keeps its storage tier there (give each its own "
                    "--hicache-storage-dir)",
                ) from None
            if made:
                os.fchmod(self.fd, 0o700)  # whatever the umask made of it
            _check_private(self.path, self.fd, exact=True)
            if keep:  # a write a dead memsvc left half done
                _remove_names(self.fd, [n for n in os.listdir(self.fd) if _OUR_TMP.fullmatch(n)])
        except BaseException as exc:
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(self.name, dir_fd=self._base_fd)
            self._close_fds()
            if isinstance(exc, OSError):
                raise _unusable(self.base, str(exc)) from exc
            raise

    def _reclaim_dead(self) -> None:
        for name in os.listdir(self._base_fd):
            if not _SUBDIR.fullmatch(name):
                continue
            try:
                fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self._base_fd)
            except OSError:
                continue  # not a directory (or a link to one): not ours
            try:
                if os.fstat(fd).st_uid != os.geteuid():
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its memsvc still runs
                _remove_names(fd, [n for n in os.listdir(fd) if _OUR_FILE.fullmatch(n)])
                try:
                    os.rmdir(name, dir_fd=self._base_fd)
                    log.info("hicache storage: removed %s, left by a memsvc that died", name)
                except OSError as exc:
                    log.warning("hicache storage: left %s in place: %s", name, exc)
            finally:
                os.close(fd)

    def close(self, names: Iterable[str]) -> None:
        """Delete ``names`` (the files this memsvc wrote), then the subdirectory."""
        if self.fd < 0:
            return
        if self.keep:  # the pages stay for the next memsvc (their index is their names)
            self._close_fds()
            return
        _remove_names(self.fd, names)
        try:
            os.rmdir(self.name, dir_fd=self._base_fd)
        except OSError as exc:
            log.warning("hicache storage: left %s in place: %s", self.path, exc)
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self.fd, self._base_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self._base_fd = -1
