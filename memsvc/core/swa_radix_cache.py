"""The radix cache of a hybrid (sliding-window) model: full KV and SWA KV kept apart.

Each tree page has its full-pool page (``node.value``, as in
:class:`RadixCache`) and maybe an SWA-pool page (``full_to_swa_page``, 0 once
freed). A page whose SWA page was freed is a *tombstone* (SGLang's word, per
page here rather than per node): the full KV is still there, the window
layers' is not::

    node pages   | full+swa | full+swa | tombstone | tombstone | full+swa | full+swa |
    a match may end where the last ``sliding_window`` tokens before it are full+swa

A prefix match is cut back to the longest page-aligned length ``M`` whose SWA
tail, the pages over positions ``[floor_page(max(0, M - W)), M)``, all hold
SWA KV (as SGLang's SWA radix cache: a request that reuses a prefix computes
its first token from the last ``W`` positions' window KV).

Eviction is per pool. :meth:`evict` (full) frees unlocked leaves, least
recently used first, with their SWA pages, as the plain radix cache does.
:meth:`evict_swa` tombstones: it frees the SWA pages of nodes, least recently
used first, locked or not, except pages *pinned* by a running request: the
tree pages in that request's window (positions ``[swa_evicted_len,
protected_len)`` of its row; :mod:`memsvc.core.swa_window`). Pinned pages
are the SWA pool's *protected* tokens; the tree's other SWA pages its
*evictable* ones.
"""

from __future__ import annotations

import numpy as np

from memsvc.core.allocator import OWNER_TREE, SLOT_DTYPE
from memsvc.core.errors import IntegrityError, InvalidArgumentError
from memsvc.core.radix_cache import MatchResult, RadixCache
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.namespace import DEFAULT_NAMESPACE


def floor_page(n: int, page_size: int) -> int:
    return n - n % page_size


def swa_tail_start(length: int, sliding_window: int, page_size: int) -> int:
    """First position whose SWA KV a request of ``length`` tokens still needs, page aligned:
    ``floor_page(max(0, length - W))`` (SGLang's ``_swa_tail_len(L) = L - this``)."""
    return floor_page(max(0, length - sliding_window), page_size)


class SWARadixCache(RadixCache):
    """A :class:`RadixCache` over a :class:`SWAPageAllocator`, with SWA tombstones."""

    allocator: SWAPageAllocator

    def __init__(
        self, allocator: SWAPageAllocator, sliding_window: int, *, disabled: bool = False
    ) -> None:
        if sliding_window < 1:
            raise InvalidArgumentError(f"sliding_window must be >= 1, got {sliding_window}")
        super().__init__(allocator, disabled=disabled)
        self.sliding_window = sliding_window
        # pins per full page: running requests whose window holds that tree page
        self._pins = np.zeros(allocator.num_pages + 1, dtype=np.int32)
        self._num_pinned_pages = 0

    # -- sizes (SWA pool tokens) ----------------------------------------------------

    def swa_total_size(self) -> int:
        """SWA tokens on tree pages (tombstones excluded). Changes nothing."""
        return self.allocator.num_tree_swa_pages * self.page_size

    def swa_protected_size(self) -> int:
        """SWA tokens on tree pages pinned by running requests' windows. Changes nothing."""
        return self._num_pinned_pages * self.page_size

    def swa_evictable_size(self) -> int:
        """SWA tokens :meth:`evict_swa` could free. Changes nothing."""
        return self.swa_total_size() - self.swa_protected_size()

    # -- match ---------------------------------------------------------------------------

    def match_prefix(self, token_ids: object, namespace: str = DEFAULT_NAMESPACE) -> MatchResult:
        """The longest cached prefix whose SWA tail is held (see the module docstring)."""
        match = super().match_prefix(token_ids, namespace)
        valid_len = self.swa_valid_len(match.slots)
        if valid_len == match.slots.size:
            return match
        key = self._as_key(token_ids)[:valid_len]
        return super().match_prefix(key, namespace)  # splits the node the shorter match ends in

    def swa_valid_len(self, slots: np.ndarray) -> int:
        """The longest page-aligned prefix of tree ``slots`` whose SWA tail has SWA pages."""
        ps, window = self.page_size, self.sliding_window
        has_swa = self.allocator.full_to_swa_page[slots[::ps] // ps] != 0
        if has_swa.all():  # the usual case: nothing tombstoned on the path
            return int(slots.size)
        ends = np.arange(1, has_swa.size + 1)  # candidate match ends, in pages
        # SWA-holding pages just before each end: the end minus its last tombstone's
        last_tombstone = np.maximum.accumulate(np.where(has_swa, 0, ends))
        needed = ends - np.maximum(ends * ps - window, 0) // ps  # the tail's pages
        valid = ends[ends - last_tombstone >= needed]
        return int(valid[-1]) * ps if valid.size else 0

    # -- insert --------------------------------------------------------------------------

    def _insert(
        self, key: np.ndarray, slots: np.ndarray, namespace: str = DEFAULT_NAMESPACE
    ) -> tuple[int, object, list[np.ndarray]]:
        """:meth:`RadixCache._insert`; then the already-cached part takes the SWA pages the
        caller's duplicate pages hold where its own are tombstones (SGLang revives a
        tombstone node from the inserted value the same way): same tokens at the same
        positions, same KV. The caller then frees its duplicates' full pages alone."""
        prefix_len, node, values = super()._insert(key, slots, namespace)
        if prefix_len:
            ps = self.page_size
            tree_pages = np.concatenate(values)[:prefix_len:ps] // ps
            given_pages = slots[:prefix_len:ps] // ps
            f2s = self.allocator.full_to_swa_page
            adopt = (tree_pages != given_pages) & (f2s[tree_pages] == 0) & (f2s[given_pages] != 0)
            if adopt.any():
                self._adopt_swa(tree_pages[adopt], given_pages[adopt])
        return prefix_len, node, values

    def _adopt_swa(self, tree_pages: np.ndarray, given_pages: np.ndarray) -> None:
        f2s = self.allocator.full_to_swa_page
        swa_pages = f2s[given_pages].astype(SLOT_DTYPE)
        owners = self.allocator.owners()[given_pages]
        for owner in np.unique(owners).tolist():
            self.allocator.set_swa_owner(swa_pages[owners == owner], OWNER_TREE, expected=owner)
        f2s[tree_pages] = swa_pages
        f2s[given_pages] = 0

    # -- pins (running requests' windows) ---------------------------------------------

    def pin(self, pages: np.ndarray) -> None:
        """A running request's window holds these tree pages: their SWA stays."""
        pages = np.asarray(pages, dtype=SLOT_DTYPE)
        if not pages.size:
            return
        if (self.allocator.owners()[pages] != OWNER_TREE).any():
            raise InvalidArgumentError("pin of pages the tree does not own")
        if (self.allocator.full_to_swa_page[pages] == 0).any():
            raise InvalidArgumentError("pin of tree pages whose SWA KV is gone")
        self._num_pinned_pages += int(np.count_nonzero(self._pins[pages] == 0))
        np.add.at(self._pins, pages, 1)

    def unpin(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=SLOT_DTYPE)
        if not pages.size:
            return
        if (self._pins[pages] <= 0).any():
            raise InvalidArgumentError("unpin of pages that are not pinned")
        np.subtract.at(self._pins, pages, 1)
        self._num_pinned_pages -= int(np.count_nonzero(self._pins[pages] == 0))

    def pins(self) -> np.ndarray:
        """Pin count per full page (a read-only view)."""
        view = self._pins.view()
        view.flags.writeable = False
        return view

    # -- eviction ------------------------------------------------------------------------

    def evict_swa(self, num_tokens: int) -> int:
        """Tombstone tree pages, least recently used nodes first, until ``num_tokens`` SWA
        tokens are freed or none is left to free; pinned pages stay. Returns the tokens freed.

        Unlike SGLang, an unlocked leaf keeps its full KV here (a tombstone leaf is for the
        full eviction to take, least recently used first).
        """
        if num_tokens < 0:
            raise InvalidArgumentError(f"cannot evict {num_tokens} tokens")
        if num_tokens == 0 or self.disabled:
            return 0
        ps = self.page_size
        nodes = sorted(self.iter_nodes(), key=lambda n: (n.last_access_time, n.node_id))
        freed, f2s = 0, self.allocator.full_to_swa_page
        for node in nodes:
            pages = node.value[::ps] // ps
            evictable = pages[(f2s[pages] != 0) & (self._pins[pages] == 0)]
            if not evictable.size:
                continue
            if freed + evictable.size * ps > num_tokens:  # the oldest pages of the node first
                evictable = evictable[: -(-(num_tokens - freed) // ps)]
            freed += self.allocator.free_swa_pages(evictable) * ps
            if freed >= num_tokens:
                break
        return freed

    def flush_swa(self) -> int:
        """Tombstone every unpinned tree page; returns the SWA tokens freed."""
        return self.evict_swa(self.swa_evictable_size())

    # -- integrity -----------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        pinned = np.flatnonzero(self._pins)
        if pinned.size != self._num_pinned_pages or (self._pins < 0).any():
            raise IntegrityError("SWA pin counter disagrees with the pins")
        if pinned.size and (self.allocator.owners()[pinned] != OWNER_TREE).any():
            raise IntegrityError("a pinned page is not the tree's")
        if pinned.size and (self.allocator.full_to_swa_page[pinned] == 0).any():
            raise IntegrityError("a pinned page has no SWA page")

    def check_idle(self) -> None:
        super().check_idle()
        if self._num_pinned_pages:
            raise IntegrityError(f"idle but {self._num_pinned_pages} tree pages are SWA-pinned")
