"""``--zero-freed-kv``: pages that held a salted request's KV are zeroed before anyone else
gets them.

A page that held KV of a non-default cache namespace (:mod:`memsvc.namespace`)
is *tainted*: every page allocated to a request of such a namespace, and every
page a match of such a request hands it (device pages of its namespace's tree,
loaded host / storage copies included). A tainted page is zeroed when the
allocator next hands it out, to whoever asks, and is clean from then on::

    salted row allocates p   -> p tainted
    ... p freed (request released, tree node evicted) ...
    anyone allocates p       -> p zeroed (before alloc_pages returns), untainted

Zeroing at allocation, not at free, is the cheap correct place: a freed page may
still be read by a copy in flight (a backup to the host tier, an offload), and
the allocator hands a page out only once every such copy is done (pending pages,
:mod:`memsvc.core.allocator`); it also zeroes a page once however often it is
freed and matched meanwhile, and never a page that is not reused. Pages of the
default namespace are never zeroed. A hybrid pool's SWA pages are tracked the same
way on the SWA allocator.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE, PageAllocator


class FreedKVScrubber:
    """Taint bits for one allocator's pages; zeroes tainted pages as they are handed out.

    ``zero(pages)`` zeroes whole pool pages and returns when they are zero;
    ``salted_rows[row]`` says whether the request on that ``req_to_token`` row is
    in a non-default namespace (the pool keeps it, :meth:`open_row`).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        zero: Callable[[np.ndarray], None],
        salted_rows: np.ndarray,
    ) -> None:
        self.allocator = allocator
        self.zero = zero
        self.salted_rows = salted_rows
        self.tainted = np.zeros(allocator.num_pages + 1, dtype=bool)
        self.num_zeroed_pages = 0
        allocator.on_alloc = self._on_alloc

    def taint(self, pages: np.ndarray) -> None:
        self.tainted[np.asarray(pages, dtype=SLOT_DTYPE)] = True

    def _on_alloc(self, pages: np.ndarray, owner: int | np.ndarray) -> None:
        dirty = pages[self.tainted[pages]]
        if dirty.size:
            self.zero(dirty)
            self.tainted[dirty] = False
            self.num_zeroed_pages += int(dirty.size)
        owners = np.asarray(owner)
        rows = np.where(owners > 0, owners, 0)  # tags <= 0: the tree, reserved, any
        if owners.ndim == 0:
            if rows and self.salted_rows[rows]:
                self.tainted[pages] = True
        else:
            self.tainted[pages[self.salted_rows[rows]]] = True


class ZeroFreedKV:
    """The pool's scrubbers: the full pool's, and the SWA pool's for a hybrid layout."""

    def __init__(self, allocator: PageAllocator, buffers, num_rows: int) -> None:
        self.salted_rows = np.zeros(num_rows + 1, dtype=bool)  # row 0 is never a request's
        self.full = FreedKVScrubber(allocator, buffers.zero_pages, self.salted_rows)
        swa = getattr(allocator, "swa", None)
        self.swa = (
            FreedKVScrubber(swa, lambda p: buffers.zero_pages(p, swa=True), self.salted_rows)
            if swa is not None
            else None
        )
        self._full_to_swa = getattr(allocator, "full_to_swa_page", None)

    def open_row(self, row: int, namespace: str) -> None:
        self.salted_rows[row] = bool(namespace)

    def taint_slots(self, slots: np.ndarray, page_size: int) -> None:
        """The pages of ``slots`` (a salted request's matched prefix) and their SWA pages."""
        pages = np.unique(np.asarray(slots, dtype=SLOT_DTYPE) // page_size)
        self.full.taint(pages)
        if self.swa is not None and self._full_to_swa is not None:
            swa_pages = self._full_to_swa[pages]
            self.swa.taint(swa_pages[swa_pages > 0])

    @property
    def num_zeroed_pages(self) -> int:
        return self.full.num_zeroed_pages + (self.swa.num_zeroed_pages if self.swa else 0)
