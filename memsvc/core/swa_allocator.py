"""Two-pool page allocator for hybrid (sliding-window) models, as SGLang's SWA allocator.

A hybrid model's full-attention layers keep every position's KV; its
sliding-window layers only the last ``sliding_window`` positions'. So the pool
is two pools of pages of the same size: the full pool (``kv``, this
allocator's own free list, the page ids in ``req_to_token``) and the SWA pool
(``swa_kv``, an inner :class:`PageAllocator`). A full page and an SWA page are
handed out together (lockstep); ``full_to_swa_page`` maps one to the other::

    alloc n pages   ->  n full pages + n SWA pages, full_to_swa_page[full] = swa
    free full pages ->  their SWA pages too (those they still have), entry = 0
    free_swa_pages  ->  only the SWA pages (out of the window, or a tree tombstone)

An allocation is all or nothing over both pools, so :meth:`available_size`
is ``min(full, swa)`` (SGLang's); :meth:`full_available_size` and
:meth:`swa_available_size` give each pool. An SWA page carries the owner tag
of its full page (a request's row, or the tree), so the integrity check sees
each pool's pages in exactly one place. Copies in flight (offload, hicache)
read only the full pool; only full pages wait behind their fences.
"""

from __future__ import annotations

import numpy as np

from memsvc.core.allocator import OWNER_ANY, OWNER_TREE, SLOT_DTYPE, PageAllocator
from memsvc.core.errors import InvalidArgumentError


class SWAPageAllocator(PageAllocator):
    """The full pool's free list (inherited) plus the SWA pool (:attr:`swa`)."""

    def __init__(
        self,
        num_pages: int,
        swa_num_pages: int,
        page_size: int,
        full_to_swa_page: np.ndarray | None = None,
    ) -> None:
        """``full_to_swa_page``: the shared int32 table (the backend's); a private one if None."""
        super().__init__(num_pages, page_size)
        if swa_num_pages < 1:
            raise InvalidArgumentError(f"need swa_num_pages >= 1, got {swa_num_pages}")
        self.swa = PageAllocator(swa_num_pages, page_size)
        if full_to_swa_page is None:
            full_to_swa_page = np.zeros(num_pages + 1, dtype=np.int32)
        if full_to_swa_page.shape != (num_pages + 1,):
            raise InvalidArgumentError(
                f"full_to_swa_page has shape {full_to_swa_page.shape}, need ({num_pages + 1},)"
            )
        self.full_to_swa_page = full_to_swa_page
        self.full_to_swa_page[:] = 0
        # SWA pages the radix tree owns, kept as a count: every memsvc reply reports the
        # tree's SWA sizes (the integrity check recounts the owner tags)
        self.num_tree_swa_pages = 0

    # -- sizes (tokens) ------------------------------------------------------------

    @property
    def swa_capacity(self) -> int:
        return self.swa.capacity

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can have: both pools must give them."""
        return min(self._num_free + self._num_pending, self.swa.num_free_pages)

    def available_size(self) -> int:
        """``min(full, swa)`` free tokens: what an allocation can have (SGLang's)."""
        return self.num_free_pages * self.page_size

    def full_available_size(self) -> int:
        return (self._num_free + self._num_pending) * self.page_size

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    # -- pages ---------------------------------------------------------------------

    def alloc_pages(self, num_pages: int, owner: int | np.ndarray = OWNER_ANY) -> np.ndarray | None:
        """``num_pages`` full pages, each with a fresh SWA page, or ``None`` (nothing changed)."""
        if num_pages > self.swa.num_free_pages:
            return None
        pages = super().alloc_pages(num_pages, owner)
        if pages is None or not pages.size:
            return pages
        swa_pages = self.swa.alloc_pages(num_pages, owner)
        assert swa_pages is not None  # checked above; the SWA pool has no pending pages
        self.full_to_swa_page[pages] = swa_pages
        owners = np.broadcast_to(np.asarray(owner), (num_pages,))
        self.num_tree_swa_pages += int(np.count_nonzero(owners == OWNER_TREE))
        return pages

    def alloc_pages_swa_tail(
        self, num_pages: int, num_swa_pages: int, owner: int
    ) -> np.ndarray | None:
        """``num_pages`` full pages, the last ``num_swa_pages`` of them with an SWA page (a
        request loaded back with its window's SWA KV alone), or ``None`` (nothing changed)."""
        if not 0 <= num_swa_pages <= num_pages:
            raise InvalidArgumentError(f"{num_swa_pages} SWA pages for {num_pages} pages")
        if num_swa_pages > self.swa.num_free_pages:
            return None
        pages = super().alloc_pages(num_pages, owner)
        if pages is None or not num_swa_pages:
            return pages
        swa_pages = self.swa.alloc_pages(num_swa_pages, owner)
        assert swa_pages is not None  # checked above; the SWA pool has no pending pages
        self.full_to_swa_page[pages[num_pages - num_swa_pages :]] = swa_pages
        self.num_tree_swa_pages += num_swa_pages * int(owner == OWNER_TREE)
        return pages

    def free_pages(self, pages: np.ndarray, owner: int | None = None) -> None:
        """Free full pages and the SWA pages they still have (validated first)."""
        pages = np.unique(np.asarray(pages, dtype=SLOT_DTYPE))
        super().free_pages(pages, owner)  # raises having changed nothing
        self._free_swa_of(pages)

    def free_swa_pages(self, pages: np.ndarray) -> int:
        """Free the SWA pages of full ``pages`` (still allocated); those without one are
        skipped. Returns the SWA pages freed."""
        pages = np.unique(np.asarray(pages, dtype=SLOT_DTYPE))
        if pages.size and not self.is_in_use(pages).all():
            raise InvalidArgumentError("free_swa_pages of full pages that are not allocated")
        return self._free_swa_of(pages)

    def _free_swa_of(self, pages: np.ndarray) -> int:
        if not pages.size:
            return 0
        swa_pages = self.full_to_swa_page[pages]
        held = swa_pages != 0
        if held.any():
            swa_pages = swa_pages[held]
            in_tree = int(np.count_nonzero(self.swa.owners()[swa_pages] == OWNER_TREE))
            self.swa.free_pages(swa_pages)
            self.num_tree_swa_pages -= in_tree
            self.full_to_swa_page[pages[held]] = 0
        return int(np.count_nonzero(held))

    def set_owner(self, pages: np.ndarray, owner: int, *, expected: int) -> None:
        pages = np.asarray(pages, dtype=SLOT_DTYPE)
        super().set_owner(pages, owner, expected=expected)
        swa_pages = self.full_to_swa_page[pages]
        self.set_swa_owner(swa_pages[swa_pages != 0], owner, expected=expected)

    def set_swa_owner(self, swa_pages: np.ndarray, owner: int, *, expected: int) -> None:
        """Hand SWA pages from ``expected`` to ``owner`` (their full pages stay put)."""
        if not swa_pages.size:
            return
        self.swa.set_owner(swa_pages, owner, expected=expected)
        moved = (owner == OWNER_TREE) - (expected == OWNER_TREE)
        self.num_tree_swa_pages += moved * int(swa_pages.size)

    def swa_pages_of(self, pages: np.ndarray) -> np.ndarray:
        """The SWA page of each full page (0: none)."""
        return self.full_to_swa_page[np.asarray(pages, dtype=SLOT_DTYPE)].astype(SLOT_DTYPE)
