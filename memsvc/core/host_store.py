"""Host store: CPU RAM copies of offloaded requests' KV.

The store is one arena of host pages, allocated and touched once at start
(pinned memory on the cuda backend), so an offload never pays for page
faults or pinning. An entry holds a request's KV in page form (token ``i`` at
arena page ``i // page_size``, offset ``i % page_size`` of its extents)::

    arena  [ entry a: 0..5 | free 6..9 | entry b: 10..13 | free 14.. ]
             one extent each in the usual case; first-fit, split only when
             no single free run is long enough

so offload and load are whole-page copies, one large copy per run of
consecutive pool pages.

An asynchronous offload returns as soon as its copies are issued; the entry
keeps their fence, and :meth:`HostStore.load` and :meth:`HostStore.read` wait
on it first. A discarded entry's arena pages can be handed to the next
offload at once: copies finish in issue order, so the new copy writes them
only after the old one is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memsvc.core.allocator import ceil_div
from memsvc.core.backends.base import KVBuffers
from memsvc.core.errors import (
    CopyFailedError,
    DuplicateRequestError,
    HostStoreFullError,
    InvalidArgumentError,
    UnknownRequestError,
)
from memsvc.core.fence import DONE, CopyFence

Extent = tuple[int, int]  # (first arena page, number of pages)


@dataclass
class HostEntry:
    num_tokens: int
    extents: list[Extent]
    fence: CopyFence = DONE  # the offload copy writing this entry
    zero: bool = False  # zeroed when dropped (--zero-freed-kv: a salted request's KV)

    @property
    def num_pages(self) -> int:
        return sum(length for _, length in self.extents)


class HostStore:
    def __init__(self, buffers: KVBuffers, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"host store capacity must be >= 0, got {capacity_bytes}")
        self._buffers = buffers
        self._page_bytes = buffers.layout.bytes_per_page
        # a pure sliding-window model's full pool has no bytes: no host store for it
        self.num_pages = capacity_bytes // self._page_bytes if self._page_bytes else 0
        self.capacity_bytes = self.num_pages * self._page_bytes
        self._arena = buffers.alloc_host(self.num_pages)
        self._arena.view(np.uint8).reshape(-1)[::4096] = 0  # fault every OS page in now
        self._free: list[Extent] = [(0, self.num_pages)] if self.num_pages else []
        self._entries: dict[str, HostEntry] = {}
        self._used_pages = 0  # kept as a count: every memsvc reply reports the free bytes

    @property
    def used_bytes(self) -> int:
        return self._used_pages * self._page_bytes

    @property
    def free_bytes(self) -> int:
        return (self.num_pages - self._used_pages) * self._page_bytes

    def free_extents(self) -> list[Extent]:
        return list(self._free)

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def rids(self) -> list[str]:
        return list(self._entries)

    def entry_bytes(self, rid: str) -> int:
        return self._entry(rid).num_pages * self._page_bytes

    def num_tokens(self, rid: str) -> int:
        return self._entry(rid).num_tokens

    def bytes_needed(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self._buffers.layout.page_size) * self._page_bytes

    def offload(self, rid: str, token_slots: np.ndarray, *, asynchronous: bool = False) -> int:
        """Copy the KV of ``token_slots`` (the request's tokens in order) out; returns bytes.

        With ``asynchronous`` the copy may still be running on return:
        :meth:`fence` says when it is done, and the pages it reads must not
        be reused before then.
        """
        if rid in self._entries:
            raise DuplicateRequestError(f"host store already holds KV for {rid!r}")
        num_pages = ceil_div(token_slots.size, self._buffers.layout.page_size)
        if not self._page_bytes:  # a pure sliding-window model's full pool: nothing to hold
            num_pages = 0
        if num_pages * self._page_bytes > self.free_bytes:
            raise HostStoreFullError(
                f"host store full: {rid!r} needs {num_pages * self._page_bytes} bytes, "
                f"{self.free_bytes} of {self.capacity_bytes} free"
            )
        extents = self._take(num_pages)
        page_size = self._buffers.layout.page_size
        fence: CopyFence = DONE
        for (first, length), token_start in zip(extents, self._token_starts(extents), strict=True):
            chunk = token_slots[token_start : token_start + length * page_size]
            out = self._arena[first : first + length]
            if asynchronous:
                fence = self._buffers.copy_out_async(chunk, out)  # in order: the last covers all
            else:
                self._buffers.copy_out(chunk, out)
        self._entries[rid] = HostEntry(token_slots.size, extents, fence)
        self._used_pages += num_pages
        return num_pages * self._page_bytes

    def fence(self, rid: str) -> CopyFence:
        """The fence of ``rid``'s offload copy (done at once for a synchronous one)."""
        return self._entry(rid).fence

    def load(self, rid: str, new_token_slots: np.ndarray) -> int:
        """Copy the KV back into ``new_token_slots`` and drop the host copy; returns bytes."""
        entry = self._settled(rid)
        if new_token_slots.size != entry.num_tokens:
            raise InvalidArgumentError(
                f"{rid!r} has {entry.num_tokens} tokens offloaded, got "
                f"{new_token_slots.size} slots to load into"
            )
        page_size = self._buffers.layout.page_size
        for (first, length), token_start in zip(
            entry.extents, self._token_starts(entry.extents), strict=True
        ):
            chunk = new_token_slots[token_start : token_start + length * page_size]
            self._buffers.copy_in(self._arena[first : first + length], chunk)
        self.discard(rid)
        return entry.num_pages * self._page_bytes

    def read(self, rid: str) -> np.ndarray:
        """The stored KV of ``rid`` as ``[tokens, layers, 2, heads, dim]`` (a copy; for tests)."""
        entry = self._settled(rid)
        pages = np.concatenate([self._arena[f : f + n] for f, n in entry.extents])
        tokens = np.arange(entry.num_tokens)
        page_size = self._buffers.layout.page_size
        return pages[tokens // page_size, :, :, tokens % page_size]

    def pages(self, rid: str) -> tuple[int, np.ndarray]:
        """``rid``'s token count and its stored pages, ``[pages, *page shape]`` in token
        order (a copy: what a migration sends to another node while the entry stays)."""
        entry = self._settled(rid)
        return entry.num_tokens, np.concatenate([self._arena[f : f + n] for f, n in entry.extents])

    def zero_on_discard(self, rid: str) -> None:
        """Zero ``rid``'s pages when its entry is dropped (loaded back or discarded)."""
        self._entry(rid).zero = True

    def discard(self, rid: str) -> None:
        entry = self._entry(rid)
        if entry.zero:
            entry.fence.wait()  # an offload still writing them would undo the zeroing
            for first, length in entry.extents:
                self._arena[first : first + length] = 0
        del self._entries[rid]
        self._used_pages -= entry.num_pages
        self._give_back(entry.extents)

    def _token_starts(self, extents: list[Extent]) -> list[int]:
        page_size = self._buffers.layout.page_size
        starts, at = [], 0
        for _, length in extents:
            starts.append(at)
            at += length * page_size
        return starts

    def _take(self, num_pages: int) -> list[Extent]:
        """First fit in one extent if any free run is long enough, else gather runs."""
        for i, (first, length) in enumerate(self._free):
            if length >= num_pages:
                if length == num_pages:
                    del self._free[i]
                else:
                    self._free[i] = (first + num_pages, length - num_pages)
                return [(first, num_pages)] if num_pages else []
        taken: list[Extent] = []
        while num_pages:
            first, length = self._free.pop(0)
            used = min(length, num_pages)
            taken.append((first, used))
            if used < length:
                self._free.insert(0, (first + used, length - used))
            num_pages -= used
        return taken

    def _give_back(self, extents: list[Extent]) -> None:
        """Return extents and merge neighbours, keeping the free list sorted."""
        merged: list[Extent] = []
        for first, length in sorted(self._free + [e for e in extents if e[1]]):
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((first, length))
        self._free = merged

    def _settled(self, rid: str) -> HostEntry:
        """``rid``'s entry once its offload copy is done; a failed copy drops it."""
        entry = self._entry(rid)
        entry.fence.wait()
        failure = entry.fence.error()
        if failure is not None:
            self.discard(rid)
            raise CopyFailedError(f"offloading {rid!r} to the host store failed: {failure}")
        return entry

    def _entry(self, rid: str) -> HostEntry:
        try:
            return self._entries[rid]
        except KeyError:
            raise UnknownRequestError(f"host store holds no KV for {rid!r}") from None
