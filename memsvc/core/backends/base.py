"""The interface every KV buffer backend implements."""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE
from memsvc.core.fence import DONE, CopyFence
from memsvc.core.layout import PoolLayout


def aligned_pages(slots: np.ndarray, page_size: int) -> np.ndarray | None:
    """The pages of ``slots`` if token ``i`` sits at offset ``i % page_size`` of
    its page and each page holds one run of tokens, else ``None``.

    That is how the allocator lays out every request, so whole pages can be
    copied (the unused tail of the last page comes along, harmlessly: the page
    belongs to the same request on both sides).
    """
    if page_size == 1:
        return slots
    num_tokens = slots.size
    pages = slots[::page_size] // page_size
    expected = np.repeat(pages, page_size)[:num_tokens] * page_size + (
        np.arange(num_tokens, dtype=SLOT_DTYPE) % page_size
    )
    return pages if np.array_equal(slots, expected) else None


def page_runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """``(index in pages, first page, run length)`` for each run of consecutive pages."""
    if pages.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), pages.size]
    return [(s, int(pages[s]), e - s) for s, e in zip(starts, ends, strict=True)]


class HostPageCopies:
    """Page and slot copies of a host (numpy) ``kv`` buffer, shared by the shm backend and
    the host store's view of the SWA pool. Needs ``self.kv`` and ``self.layout``."""

    kv: np.ndarray
    layout: Any

    def alloc_host(self, num_pages: int) -> np.ndarray:
        # Page-aligned like the pool (an anonymous mapping, not malloc): a
        # destination 16 bytes past a 4 KiB boundary from its source makes
        # memcpy hit 4K aliasing and run at a third of its speed.
        shape = (num_pages, *self.layout.kv_shape[1:])
        nbytes = max(num_pages * self.layout.bytes_per_page, 1)
        return np.frombuffer(
            mmap.mmap(-1, nbytes), self.layout.storage_dtype, count=int(np.prod(shape))
        ).reshape(shape)

    # Runs of consecutive pages become one slice copy (a memcpy) each; a fresh
    # pool hands out consecutive pages, so a request is usually a few runs.
    # (np.take over pages is several times slower than memcpy.)

    def gather_pages(self, pages: np.ndarray, out: np.ndarray) -> None:
        for index, first, length in page_runs(pages):
            out[index : index + length] = self.kv[first : first + length]

    def scatter_pages(self, src: np.ndarray, pages: np.ndarray) -> None:
        for index, first, length in page_runs(pages):
            self.kv[first : first + length] = src[index : index + length]

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        page_size = self.layout.page_size
        return self.kv[slots // page_size, :, :, slots % page_size]

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        page_size = self.layout.page_size
        self.kv[slots // page_size, :, :, slots % page_size] = data


class KVBuffers(ABC):
    """Owner side: the KV buffer, the ``req_to_token`` table, host buffers, copies.

    ``req_to_token`` is always a host numpy array that the control plane reads
    and writes; on ``shm`` it is the shared table itself, on ``cuda`` a host
    mirror that :meth:`write_row` keeps in step with the device table.
    """

    layout: PoolLayout
    req_to_token: np.ndarray
    # Hybrid layouts only (None otherwise): the SWA pool's buffer and the full page ->
    # SWA page table (host arrays on shm; see the backend for where the device's live).
    swa_kv: Any = None
    full_to_swa_page: np.ndarray | None = None

    @abstractmethod
    def handle(self) -> dict[str, Any]:
        """A msgpack-serializable description another process can ``attach()``."""

    @abstractmethod
    def write_row(self, row: int, start: int, values: np.ndarray) -> None:
        """``req_to_token[row, start:start+len(values)] = values`` (host and device)."""

    @abstractmethod
    def write_cells(self, rows: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        """``req_to_token[rows[i], positions[i]] = values[i]`` (host and device)."""

    def write_full_to_swa(self, full_pages: np.ndarray, swa_pages: np.ndarray | int) -> None:
        """``full_to_swa_page[full_pages[i]] = swa_pages[i]`` (0: no SWA page); hybrid only.
        This default writes the host table, which on shm is the shared one itself."""
        assert self.full_to_swa_page is not None, "not a hybrid layout"
        self.full_to_swa_page[np.asarray(full_pages, dtype=np.int64)] = swa_pages

    @abstractmethod
    def alloc_host(self, num_pages: int) -> np.ndarray:
        """A host buffer of ``num_pages`` pages, shaped like ``kv[:num_pages]``."""

    @abstractmethod
    def gather_pages(self, pages: np.ndarray, out: np.ndarray) -> None:
        """Copy pool pages into the host buffer ``out[:len(pages)]``; returns when done."""

    @abstractmethod
    def scatter_pages(self, src: np.ndarray, pages: np.ndarray) -> None:
        """Copy host pages ``src[:len(pages)]`` into pool pages; returns when done."""

    @abstractmethod
    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        """KV of the given token slots, ``[n, layers, 2, heads, dim]`` on the host."""

    def zero_pages(self, pages: np.ndarray, *, swa: bool = False) -> None:
        """Zero whole pool pages (the SWA pool's with ``swa``); returns when they are zero."""
        buffer = self.swa_kv if swa else self.kv
        for _, first, length in page_runs(np.asarray(pages, dtype=np.int64)):
            buffer[first : first + length] = 0

    @abstractmethod
    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        """Inverse of :meth:`read_slots`."""

    @abstractmethod
    def close(self) -> None:
        """Release the buffers (and unlink shared names). Idempotent."""

    # -- request-sized copies, built on the primitives above -------------------

    def copy_out(self, slots: np.ndarray, out: np.ndarray) -> None:
        """KV of ``slots`` (one request's tokens in order) into a host page buffer."""
        page_size = self.layout.page_size
        pages = aligned_pages(slots, page_size)
        if pages is not None:
            self.gather_pages(pages, out)
            return
        positions = np.arange(slots.size)
        # advanced indices on axes 0 and 3 put the token axis first: [n, layers, 2, heads, dim]
        out[positions // page_size, :, :, positions % page_size] = self.read_slots(slots)

    def copy_out_async(self, slots: np.ndarray, out: np.ndarray) -> CopyFence:
        """Start :meth:`copy_out`; the fence says when it has finished.

        The pages of ``slots`` must not be reused, nor ``out`` read, before
        then. Copies finish in issue order. This default copies synchronously.
        """
        self.copy_out(slots, out)
        return DONE

    def submit(self, fn: Callable[..., Any], *args: Any) -> CopyFence:
        """Run ``fn(*args)`` after every copy issued before it; the fence says when it ended.

        The hierarchical cache's copies (device <-> host tier, storage I/O)
        run this way, in issue order with the offload copies. This default
        runs it at once (an exception propagates) and returns a done fence.
        """
        fn(*args)
        return DONE

    def copy_in(self, src: np.ndarray, slots: np.ndarray) -> None:
        """Inverse of :meth:`copy_out`."""
        page_size = self.layout.page_size
        pages = aligned_pages(slots, page_size)
        if pages is not None:
            self.scatter_pages(src, pages)
            return
        positions = np.arange(slots.size)
        self.write_slots(slots, src[positions // page_size, :, :, positions % page_size])

    def __enter__(self) -> KVBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AttachedBuffers(ABC):
    """Attacher side: zero-copy views of another process's pool."""

    layout: PoolLayout
    swa_kv: Any = None  # hybrid layouts only
    full_to_swa_page: Any = None

    @abstractmethod
    def kv_torch(self) -> Any:
        """The KV buffer as a torch tensor of shape ``layout.kv_shape``."""

    @abstractmethod
    def req_to_token_torch(self) -> Any:
        """The ``req_to_token`` table as an int32 torch tensor."""

    def swa_kv_torch(self) -> Any:
        """The SWA pool's buffer, shape ``layout.swa_kv_shape``; None unless hybrid."""
        return None

    def full_to_swa_page_torch(self) -> Any:
        """The int32 full page -> SWA page table, shape ``(num_pages + 1,)`` (0: no SWA
        page); None unless hybrid."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Drop the mapping (the owner's segments are not removed)."""

    def __enter__(self) -> AttachedBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
