"""Each open request's sliding window over its row: which positions still hold SWA KV.

A hybrid model's sliding-window layers read, for the query at position ``q``,
the keys at positions ``q - W < p <= q``. Positions below every query still to
run never need their SWA KV again; their SWA pages are freed as the request
grows (SGLang's ``swa_evicted_seqlen``, page aligned)::

    row   | tombstoned / freed SWA  |<------------- SWA held -------------->|
          0                   swa_evicted_len                            kv_len
          |<---- tree's (protected_len) ---->|<---- the request's own ---->|
          tree pages in [swa_evicted_len, protected_len): pinned (the tree keeps their SWA)
          own pages below swa_evicted_len: SWA page freed (full page kept)

With the overlap schedule memsvc allocates batch ``n + 1`` while batch ``n``
runs, so the frontier follows the *previous* allocation of the row, the
oldest that may still be running, whose first query ``s_prev`` reads from
``s_prev - W + 1`` on: after each allocation the frontier is
``floor_page(max(0, s_prev + 1 - W))``. In a decode run that is
``floor_page(L - 1 - W)`` for ``L = kv_len``: SGLang's ``_evict_swa(req,
seqlen - 1)`` without its page margin. The first decode step after an extend
keeps the whole extend's window (SGLang skips that step's eviction for the
same reason). A decode slot reserved ahead and handed back unwritten
(:meth:`SWAWindows.dropped`) never ran: the previous allocation is again the
one before it, which may still be running.
"""

from __future__ import annotations

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE
from memsvc.core.req_to_token import ReqToTokenTable
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_radix_cache import SWARadixCache, swa_tail_start


class SWAWindows:
    """Per row: ``swa_evicted_len`` and the start of its last allocation; the tree pins."""

    def __init__(
        self,
        table: ReqToTokenTable,
        allocator: SWAPageAllocator,
        tree: SWARadixCache,
        sliding_window: int,
    ) -> None:
        self.table = table
        self.allocator = allocator
        self.tree = tree
        self.sliding_window = sliding_window
        self.page_size = allocator.page_size
        self.evicted_lens = np.zeros(table.num_rows, dtype=np.int64)  # swa_evicted_seqlen
        self.alloc_starts = np.zeros(table.num_rows, dtype=np.int64)
        self.prev_starts = np.zeros(table.num_rows, dtype=np.int64)  # the one before
        self.protected_lens = np.zeros(table.num_rows, dtype=np.int64)
        self._pinned: dict[int, np.ndarray] = {}  # row -> the tree pages it pins

    def frontier(self, starts: np.ndarray) -> np.ndarray:
        """``floor_page(max(0, start + 1 - W))`` for each allocation start."""
        front = np.maximum(starts + 1 - self.sliding_window, 0)
        return front - front % self.page_size

    # -- a request's life ------------------------------------------------------------

    def open(self, row: int, protected_len: int) -> None:
        """``row`` holds a matched prefix of ``protected_len`` tokens (0: none) and no
        KV of its own: its window starts at the prefix's SWA tail."""
        self.close(row)
        self.evicted_lens[row] = swa_tail_start(protected_len, self.sliding_window, self.page_size)
        self.alloc_starts[row] = self.prev_starts[row] = protected_len
        self._set_protected(row, protected_len)

    def close(self, row: int) -> None:
        """The request releases its window's pins (its pages go with its hand-back)."""
        pinned = self._pinned.pop(row, None)
        if pinned is not None:
            self.tree.unpin(pinned)
        self.evicted_lens[row] = self.protected_lens[row] = 0
        self.alloc_starts[row] = self.prev_starts[row] = 0

    def published(self, row: int, protected_len: int) -> None:
        """The request's KV up to ``protected_len`` went into the tree (it runs on it)."""
        self._set_protected(row, protected_len)

    def allocated(self, rows: np.ndarray, starts: np.ndarray) -> None:
        """``rows`` were each given positions from ``starts`` on: free the SWA pages that
        left every window still to run (see the module docstring), in one free. The
        allocation's caller frees them first (:meth:`release`), so it can use them."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        self.release(rows)
        self.prev_starts[rows] = self.alloc_starts[rows]
        self.alloc_starts[rows] = starts

    def release(self, rows: np.ndarray) -> None:
        """Before ``rows`` are given new positions: free the SWA pages below the window
        of each row's latest allocation (the oldest batch that may still run once the
        new one is allocated), and unpin the tree pages there (then evictable). The
        pages an allocation for ``rows`` frees, freed before it is judged."""
        rows = np.asarray(rows, dtype=np.int64)
        new = np.maximum(self.frontier(self.alloc_starts[rows]), self.evicted_lens[rows])
        advancing = np.flatnonzero(new > self.evicted_lens[rows])
        if not advancing.size:
            return
        ps, table = self.page_size, self.table.array
        own_slots, repin = [], []
        for i in advancing.tolist():
            row, new_evicted = int(rows[i]), int(new[i])
            old, protected = int(self.evicted_lens[row]), int(self.protected_lens[row])
            own_from = max(old, protected)
            if new_evicted > own_from:  # the request's own pages: their SWA pages go
                own_slots.append(table[row, own_from:new_evicted:ps])
            self.evicted_lens[row] = new_evicted
            if old < protected:  # tree pages left the window: no longer pinned
                repin.append(row)
        if own_slots:
            pages = np.concatenate(own_slots).astype(SLOT_DTYPE) // ps
            self.allocator.free_swa_pages(pages)
        for row in repin:
            self._repin(row)

    def loaded(self, row: int, swa_from: int, kv_len: int) -> None:
        """The (empty, unpinned) row was given back ``kv_len`` positions whose SWA KV starts at
        ``swa_from`` (a host-store load): its window is as if its latest allocation started
        at ``kv_len``, the first position still to run, whose window starts after ``swa_from``."""
        self.evicted_lens[row] = swa_from
        self.alloc_starts[row] = self.prev_starts[row] = kv_len

    def dropped(self, row: int) -> None:
        """The row's latest allocation (a decode slot reserved ahead) was handed back
        unwritten: it never ran, so the allocation before it is the latest again. Unless
        a later allocation call (that did not fit) already freed below the dropped one's
        window (:meth:`release`): the one before it had run by then, so the dropped one
        stays the latest (its start is where the row's next position goes)."""
        prev = self.prev_starts[row : row + 1]
        if self.evicted_lens[row] <= self.frontier(prev)[0]:
            self.alloc_starts[row] = self.prev_starts[row]

    # -- internals ---------------------------------------------------------------------

    def _set_protected(self, row: int, protected_len: int) -> None:
        self.protected_lens[row] = protected_len
        # a prefix published past the window: what lies below it was never pinned
        self._repin(row)

    def _repin(self, row: int) -> None:
        ps = self.page_size
        start, end = int(self.evicted_lens[row]), int(self.protected_lens[row])
        pages = (
            self.table.read(row, start, end)[::ps] // ps
            if end > start
            else np.empty(0, dtype=SLOT_DTYPE)
        )
        self.tree.pin(pages)  # first, so a page pinned before and after never drops to 0
        old = self._pinned.pop(row, None)
        if old is not None:
            self.tree.unpin(old)
        if pages.size:
            self._pinned[row] = pages

    def pinned_pages(self, row: int) -> np.ndarray:
        return self._pinned.get(row, np.empty(0, dtype=SLOT_DTYPE))
