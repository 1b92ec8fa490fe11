"""POSIX shared-memory backend (the default; no GPU needed).

Segments are files under ``/dev/shm`` (what ``shm_open`` creates on Linux),
named ``kvstack-<pid>-<random>-<what>`` so a leak is easy to spot. The owner
unlinks them on :meth:`ShmBuffers.close`, at interpreter exit (a
``weakref.finalize``), and on SIGTERM once :func:`install_sigterm_cleanup` has
been called. Attachers map the same bytes; nothing is copied.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import signal
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from memsvc.core.backends.base import AttachedBuffers, HostPageCopies, KVBuffers
from memsvc.core.errors import BackendUnavailableError, InvalidArgumentError
from memsvc.core.fence import CopyFence, FutureFence
from memsvc.core.layout import PoolLayout

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvstack-"


def _segment_path(name: str) -> str:
    if "/" in name or not name.startswith(SEGMENT_PREFIX):
        raise InvalidArgumentError(f"not a kvstack segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def _map_segment(name: str, size: int, *, create: bool) -> mmap.mmap:
    size = max(size, 1)  # a pure-SWA model's kv buffer has no bytes; mmap needs one
    path = _segment_path(name)
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError as exc:
        raise BackendUnavailableError(f"shared-memory segment {name} does not exist") from exc
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise InvalidArgumentError(f"segment {name} is smaller than the handle says")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _view(mapping: mmap.mmap, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def _unlink_quietly(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _close_mapping(mapping: mmap.mmap) -> None:
    # BufferError: numpy/torch views still exist; the mapping goes away with them.
    with contextlib.suppress(BufferError):
        mapping.close()


def list_segments() -> list[str]:
    """Every kvstack segment currently in ``/dev/shm`` (for leak checks)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return []


def segment_owner_pid(name: str) -> int | None:
    """The pid of the process that created segment ``name`` (from its name)."""
    parts = name[len(SEGMENT_PREFIX) :].split("-", 1)
    return int(parts[0]) if parts[0].isdigit() else None


def install_sigterm_cleanup() -> None:
    """Make SIGTERM exit through ``SystemExit`` so finalizers unlink our segments.

    For processes that own a pool and have no SIGTERM handling of their own;
    the services, before their shell handles SIGTERM and once it no longer
    does (:mod:`memsvc.lifeline`, :func:`memsvc.server.stop_on_signals`).
    """

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


class ShmBuffers(HostPageCopies, KVBuffers):
    def __init__(self, layout: PoolLayout) -> None:
        if not os.path.isdir(SHM_DIR):
            raise BackendUnavailableError(f"{SHM_DIR} is missing: the shm backend needs Linux")
        self.layout = layout
        stem = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.kv_name = f"{stem}-kv"
        self.req_to_token_name = f"{stem}-r2t"
        names = [self.kv_name, self.req_to_token_name]
        if layout.is_hybrid:  # the SWA pool and the full page -> SWA page table
            self.swa_kv_name = f"{stem}-swa"
            self.full_to_swa_page_name = f"{stem}-f2s"
            names += [self.swa_kv_name, self.full_to_swa_page_name]
        # Registered before creating anything, so a failure half-way still unlinks.
        self._finalizer = weakref.finalize(self, _unlink_quietly, [_segment_path(n) for n in names])
        self._kv_map = _map_segment(self.kv_name, layout.kv_bytes, create=True)
        self._r2t_map = _map_segment(self.req_to_token_name, layout.req_to_token_bytes, create=True)
        self.kv = _view(self._kv_map, layout.storage_dtype, layout.kv_shape)
        self.req_to_token = _view(self._r2t_map, np.int32, layout.req_to_token_shape)
        self._maps = [self._kv_map, self._r2t_map]
        if layout.is_hybrid:
            swa_map = _map_segment(self.swa_kv_name, layout.swa_kv_bytes, create=True)
            f2s_map = _map_segment(
                self.full_to_swa_page_name, layout.full_to_swa_page_bytes, create=True
            )
            self._maps += [swa_map, f2s_map]
            self.swa_kv = _view(swa_map, layout.storage_dtype, layout.swa_kv_shape)
            self.full_to_swa_page = _view(f2s_map, np.int32, layout.full_to_swa_page_shape)
        self._copier: ThreadPoolExecutor | None = None  # started by the first async copy

    def handle(self) -> dict[str, Any]:
        return {
            "backend": "shm",
            "layout": self.layout.to_dict(),
            "kv": self.kv_name,
            "req_to_token": self.req_to_token_name,
            **(
                {"swa_kv": self.swa_kv_name, "full_to_swa_page": self.full_to_swa_page_name}
                if self.layout.is_hybrid
                else {}
            ),
        }

    def write_row(self, row: int, start: int, values: np.ndarray) -> None:
        self.req_to_token[row, start : start + values.size] = values

    def write_cells(self, rows: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        self.req_to_token[rows, positions] = values

    def copy_out_async(self, slots: np.ndarray, out: np.ndarray) -> CopyFence:
        """The copy runs on one copy thread (numpy releases the GIL while it
        copies), so copies finish in issue order."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
        # slots may be a view of a row that is zeroed when the request closes
        return FutureFence(self._copier.submit(self.copy_out, slots.copy(), out))

    def submit(self, fn: Callable[..., Any], *args: Any) -> CopyFence:
        """On the copy thread, after every copy issued before it."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")
        return FutureFence(self._copier.submit(fn, *args))

    def close(self) -> None:
        if not self._finalizer.alive:
            return
        if self._copier is not None:
            self._copier.shutdown(wait=True)  # no copy may touch the mapping after this
        self._finalizer()  # unlink first: existing mappings stay valid
        self.kv = self.req_to_token = None  # type: ignore[assignment]
        self.swa_kv = self.full_to_swa_page = None
        for mapping in self._maps:
            _close_mapping(mapping)


class ShmAttached(AttachedBuffers):
    def __init__(self, handle: dict[str, Any]) -> None:
        self.layout = layout = PoolLayout.from_dict(handle["layout"])
        self._maps: list[mmap.mmap] = []
        self.kv = self._attach(handle["kv"], layout.kv_bytes, layout.storage_dtype, layout.kv_shape)
        self.req_to_token = self._attach(
            handle["req_to_token"], layout.req_to_token_bytes, np.int32, layout.req_to_token_shape
        )
        if layout.is_hybrid:
            self.swa_kv = self._attach(
                handle["swa_kv"], layout.swa_kv_bytes, layout.storage_dtype, layout.swa_kv_shape
            )
            self.full_to_swa_page = self._attach(
                handle["full_to_swa_page"],
                layout.full_to_swa_page_bytes,
                np.int32,
                layout.full_to_swa_page_shape,
            )

    def _attach(self, name: str, size: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        mapping = _map_segment(name, size, create=False)
        self._maps.append(mapping)
        return _view(mapping, dtype, shape)

    def _kv_tensor(self, array: np.ndarray) -> Any:
        import torch

        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if self.layout.dtype == "bfloat16" else tensor

    def kv_torch(self) -> Any:
        return self._kv_tensor(self.kv)

    def req_to_token_torch(self) -> Any:
        import torch

        return torch.from_numpy(self.req_to_token)

    def swa_kv_torch(self) -> Any:
        return None if self.swa_kv is None else self._kv_tensor(self.swa_kv)

    def full_to_swa_page_torch(self) -> Any:
        import torch

        return None if self.full_to_swa_page is None else torch.from_numpy(self.full_to_swa_page)

    def close(self) -> None:
        self.kv = self.req_to_token = None  # type: ignore[assignment]
        self.swa_kv = self.full_to_swa_page = None
        for mapping in self._maps:
            _close_mapping(mapping)
