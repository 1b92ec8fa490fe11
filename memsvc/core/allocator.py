"""Page allocator: the free-page list of the KV pool.

The pool is ``num_pages + 1`` pages of ``page_size`` token slots each; page 0
is a reserved padding page and is never handed out. A token slot index is
``page * page_size + offset``. Callers allocate whole pages and think in
slots; the allocator thinks in pages only.

Allocation is all-or-nothing: a call that cannot be satisfied returns ``None``
and changes nothing. Freed pages are reused first (the free list is a stack).

Pages freed while an asynchronous copy may still read them (an offload to the
host store) are not reusable yet: they wait, tagged pending, behind the fence
of the newest copy issued before the free::

    offload r (async) -> fence F     release r -> r's pages: pending behind F
    alloc needs them  -> wait F, then they join the free list, then allocate

Copies complete in issue order (one copy stream / one copy thread), so the
newest fence covers every copy that could read a page freed now. A copy that
names the pages it reads (:meth:`copy_reads`: the hierarchical cache's
backups) holds back only those: a page freed while it runs waits for it, and
other frees do not. Pending pages count as available: an allocation that needs
them waits for their fences instead of failing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from memsvc.core.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidPageError,
    PageOwnershipError,
)
from memsvc.core.fence import CopyFence

SLOT_DTYPE = np.int64

# Page owner tags. A request's pages are tagged with its req_to_token row (>= 1).
OWNER_FREE = 0
OWNER_TREE = -1
OWNER_RESERVED = -2
OWNER_ANY = -3  # pages allocated without naming an owner (standalone use, tests)
OWNER_PENDING = -4  # freed, waiting for an in-flight copy that may read them


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Free list of pages ``1..num_pages`` with an owner tag per page.

    The owner tags make bad frees cheap to catch (a page freed twice, or freed
    by someone who does not hold it, e.g. a page the radix tree owns) and let
    the integrity check see every page's place in O(pages).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise InvalidArgumentError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack in a numpy array, top at _num_free: page 1 is handed out first.
        self._free = np.arange(num_pages, 0, -1, dtype=SLOT_DTYPE)
        self._num_free = num_pages
        self._owner = np.zeros(num_pages + 1, dtype=np.int32)
        self._owner[0] = OWNER_RESERVED  # the padding page is never handed out
        self._copy_fence: CopyFence | None = None  # the newest copy that may still run
        # (copy, the pages it reads) of the copy_reads copies maybe still running
        self._reads: list[tuple[CopyFence, np.ndarray]] = []
        self._pending: deque[tuple[list[CopyFence], np.ndarray]] = deque()
        self._num_pending = 0
        # Told of every allocation (pages, owner) before it returns: --zero-freed-kv's
        # scrubber (memsvc.core.scrub) zeroes tainted pages there.
        self.on_alloc: Callable[[np.ndarray, int | np.ndarray], None] | None = None

    # -- sizes -----------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Usable token slots (page 0 excluded)."""
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can have: free now, or pending behind a copy."""
        return self._num_free + self._num_pending

    @property
    def num_pending_pages(self) -> int:
        return self._num_pending

    def available_size(self) -> int:
        """Free token slots (whole free pages only, pending ones included)."""
        return (self._num_free + self._num_pending) * self.page_size

    # -- copies in flight --------------------------------------------------------

    def copy_issued(self, fence: CopyFence) -> None:
        """An asynchronous copy that reads pool pages was started; ``fence`` says when it ends."""
        self._copy_fence = fence

    def copy_reads(self, fence: CopyFence, pages: np.ndarray) -> None:
        """An asynchronous copy that reads ``pages`` and no other pool page was started:
        those pages, if freed before ``fence`` is done, wait for it; other frees do not."""
        if not fence.done():
            self._reads.append((fence, np.asarray(pages, dtype=SLOT_DTYPE).copy()))

    def reclaim(self, *, need: int = 0) -> None:
        """Move pending pages whose copies are done to the free list; with ``need``,
        wait on fences (oldest first) until that many pages are free or none is pending."""
        while self._pending:
            fences, pages = self._pending[0]
            if not all(fence.done() for fence in fences):
                if self._num_free >= need:
                    return
                for fence in fences:
                    fence.wait()
            self._pending.popleft()
            self._num_pending -= pages.size
            self._push_free(pages)

    def drain(self) -> None:
        """Wait for every copy in flight and free every pending page."""
        self.reclaim(need=self.num_pages + 1)  # more than can ever be free: waits for all
        if self._copy_fence is not None:
            self._copy_fence.wait()
            self._copy_fence = None

    def pending_page_list(self) -> list[int]:
        return [int(p) for _, pages in self._pending for p in pages]

    # -- pages -----------------------------------------------------------------

    def alloc_pages(self, num_pages: int, owner: int | np.ndarray = OWNER_ANY) -> np.ndarray | None:
        """Take ``num_pages`` free pages, or return ``None`` if there are not enough.

        ``owner`` is one tag for all, or one tag per page.
        """
        if num_pages < 0:
            raise InvalidArgumentError(f"cannot allocate {num_pages} pages")
        if num_pages > self._num_free:
            if num_pages > self._num_free + self._num_pending:
                return None
            self.reclaim(need=num_pages)
        if num_pages == 0:
            return np.empty(0, dtype=SLOT_DTYPE)
        top = self._num_free
        pages = self._free[top - num_pages : top][::-1].copy()
        self._num_free = top - num_pages
        self._owner[pages] = owner
        if self.on_alloc is not None:
            self.on_alloc(pages, owner)
        return pages

    def free_pages(self, pages: np.ndarray, owner: int | None = None) -> None:
        """Return pages to the free list; with ``owner``, each page must be held by it.

        Validates everything before changing anything.
        """
        pages = np.unique(np.asarray(pages, dtype=SLOT_DTYPE))
        if pages.size == 0:
            return
        if pages[0] < 1 or pages[-1] > self.num_pages:
            raise InvalidPageError(
                f"page index out of range 1..{self.num_pages}: {pages[0]}..{pages[-1]}"
            )
        owners = self._owner[pages]
        already_free = pages[(owners == OWNER_FREE) | (owners == OWNER_PENDING)]
        if already_free.size:
            raise DoubleFreeError(f"pages already free: {already_free[:8].tolist()}")
        if owner is not None and (owners != owner).any():
            wrong = pages[owners != owner]
            holder = _owner_name(int(self._owner[wrong[0]]))
            raise PageOwnershipError(
                f"pages {wrong[:8].tolist()} are held by {holder}, not by {_owner_name(owner)}"
            )
        fences = []
        fence = self._copy_fence
        if fence is not None and not fence.done():
            fences.append(fence)
        else:
            self._copy_fence = None
        if self._reads:  # few at a time: the copies still running, pruned here
            self._reads = [(f, read) for f, read in self._reads if not f.done()]
            for reader, read in self._reads:
                if reader not in fences and np.isin(pages, read).any():
                    fences.append(reader)
        if fences:
            self._owner[pages] = OWNER_PENDING
            self._pending.append((fences, pages))
            self._num_pending += pages.size
            return
        self._push_free(pages)

    def _push_free(self, pages: np.ndarray) -> None:
        self._owner[pages] = OWNER_FREE
        top = self._num_free
        self._free[top : top + pages.size] = pages[::-1]
        self._num_free = top + pages.size

    # -- slots -----------------------------------------------------------------

    def alloc(self, num_tokens: int, owner: int = OWNER_ANY) -> np.ndarray | None:
        """Allocate ``num_tokens`` slots as whole pages; ``num_tokens`` must be page-aligned."""
        if num_tokens < 0 or num_tokens % self.page_size:
            raise InvalidArgumentError(
                f"alloc needs a non-negative multiple of page_size {self.page_size}, "
                f"got {num_tokens}"
            )
        pages = self.alloc_pages(num_tokens // self.page_size, owner)
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def free(self, slots: np.ndarray, owner: int | None = None) -> None:
        """Free the pages that the given slots live on (each page once)."""
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        if slots.size == 0:
            return
        self.check_slots(slots)
        self.free_pages(slots // self.page_size, owner)

    def pages_to_slots(self, pages: np.ndarray) -> np.ndarray:
        offsets = np.arange(self.page_size, dtype=SLOT_DTYPE)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def check_slots(self, slots: np.ndarray) -> None:
        """Raise ``InvalidPageError`` unless every slot lies on a usable page."""
        if slots.size == 0:
            return
        lo, hi = int(slots.min()), int(slots.max())
        if lo < self.page_size or hi >= (self.num_pages + 1) * self.page_size:
            raise InvalidPageError(
                f"slot index out of range {self.page_size}.."
                f"{(self.num_pages + 1) * self.page_size - 1}: {lo}..{hi}"
            )

    def is_in_use(self, pages: np.ndarray) -> np.ndarray:
        owners = self._owner[np.asarray(pages, dtype=SLOT_DTYPE)]
        return (owners != OWNER_FREE) & (owners != OWNER_PENDING)

    def owners(self) -> np.ndarray:
        """Owner tag of every page (index = page); a read-only view."""
        view = self._owner.view()
        view.flags.writeable = False
        return view

    def set_owner(self, pages: np.ndarray, owner: int, *, expected: int) -> None:
        """Hand pages from ``expected`` to ``owner`` (e.g. a request's pages to the tree)."""
        pages = np.asarray(pages, dtype=SLOT_DTYPE)
        if (self._owner[pages] != expected).any():
            raise PageOwnershipError(f"pages not held by {_owner_name(expected)}")
        self._owner[pages] = owner

    def free_page_list(self) -> list[int]:
        """A copy of the free list, bottom of the stack first (for integrity checks)."""
        return self._free[: self._num_free].tolist()


def _owner_name(owner: int) -> str:
    names = {
        OWNER_FREE: "nobody",
        OWNER_TREE: "the radix tree",
        OWNER_RESERVED: "the pool",
        OWNER_ANY: "an anonymous holder",
        OWNER_PENDING: "nobody (freed, waiting for a copy)",
    }
    return names.get(owner, f"request row {owner}")


def extend_slots(
    pages: np.ndarray, page_size: int, start_len: int, num_tokens: int, last_slot: int
) -> np.ndarray:
    """Slots for positions ``start_len .. start_len + num_tokens - 1`` of one request.

    ::

        positions   |<- rest of the partly filled last page ->|<- new pages ... ->|
                    start_len                     ceil_page(start_len)
        slot        last_slot+1, last_slot+2, ...              page*ps + pos % ps

    ``pages`` are the new pages, exactly ``ceil(end/ps) - ceil(start/ps)`` of them;
    ``last_slot`` is the slot of position ``start_len - 1`` (ignored when
    ``start_len`` is page-aligned). This is SGLang's three-part ``alloc_extend``
    (rest of the current page, whole pages, one partial page) in one formula;
    decode is the case ``num_tokens == 1``.
    """
    pos = np.arange(start_len, start_len + num_tokens, dtype=SLOT_DTYPE)
    first_new_page = ceil_div(start_len, page_size)
    page_idx = pos // page_size - first_new_page
    in_new = page_idx >= 0
    slots = np.empty(num_tokens, dtype=SLOT_DTYPE)
    slots[in_new] = pages[page_idx[in_new]] * page_size + pos[in_new] % page_size
    head = ~in_new  # positions that continue the partly filled last page
    if head.any():
        slots[head] = last_slot + 1 + (pos[head] - start_len)
    return slots


def num_new_pages(page_size: int, start_len: int, end_len: int) -> int:
    """Pages consumed by growing a request from ``start_len`` to ``end_len`` tokens."""
    return ceil_div(end_len, page_size) - ceil_div(start_len, page_size)
