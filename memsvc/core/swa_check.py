"""The integrity check's SWA part (hybrid models): the second pool and each request's window.

Called by :func:`memsvc.core.integrity.check_pool`, which checks the full pool::

    SWA owner tags == SWA free list + the pages full_to_swa_page maps to
    full_to_swa_page[f] = s != 0  ->  f in use, s held by f's owner, s mapped by f alone
    each request: own pages from swa_evicted_len on hold an SWA page, those below none;
                  tree pages in [swa_evicted_len, protected_len) pinned by it, with SWA
                  swa_evicted_len <= the frontier of its latest allocation (never inside
                  a window still to run)
    pins == the requests' pinned pages
    swa available + evictable + protected + held == swa capacity
    idle: swa available + evictable == swa capacity, nothing pinned
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.allocator import OWNER_FREE, OWNER_PENDING, OWNER_TREE, SLOT_DTYPE
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_radix_cache import SWARadixCache

if TYPE_CHECKING:
    from memsvc.core.pool import KVPool


def check_swa(pool: KVPool, problems: list[str], *, idle: bool) -> None:
    """Append what is wrong with the SWA pool and the windows to ``problems``."""
    allocator, tree, windows = pool.allocator, pool.tree, pool.swa
    assert isinstance(allocator, SWAPageAllocator) and isinstance(tree, SWARadixCache)
    assert windows is not None
    ps = pool.page_size
    _check_mapping(allocator, problems)
    pins: Counter[int] = Counter()
    for req in (pool.request(rid) for rid in pool.open_rids()):
        row = req.row
        evicted = int(windows.evicted_lens[row])
        protected = int(windows.protected_lens[row])
        if protected != req.protected_len:
            problems.append(f"{req.rid}: window protected_len {protected} != {req.protected_len}")
            continue
        if evicted % ps or evicted > max(req.kv_len, protected):
            problems.append(f"{req.rid}: swa_evicted_len {evicted} is off")
            continue
        frontier = int(windows.frontier(np.array([windows.alloc_starts[row]]))[0])
        if evicted > frontier:
            problems.append(
                f"{req.rid}: SWA freed up to {evicted}, inside the window of its latest "
                f"allocation (frontier {frontier})"
            )
        slots = pool.table.read(row, 0, req.kv_len)
        starts = np.arange(0, req.kv_len, ps)
        has_swa = allocator.full_to_swa_page[slots[::ps] // ps] != 0
        own = starts >= protected
        if (has_swa[own] != (starts[own] >= evicted)).any():
            problems.append(f"{req.rid}: own pages hold SWA pages outside [{evicted}, kv_len)")
        window_pages = slots[evicted:protected:ps] // ps if protected > evicted else slots[:0]
        pinned = windows.pinned_pages(row)
        if not np.array_equal(np.sort(pinned), np.sort(window_pages)):
            problems.append(
                f"{req.rid}: pins {pinned.size} tree pages, its window has {window_pages.size}"
            )
        if window_pages.size and (allocator.full_to_swa_page[window_pages] == 0).any():
            problems.append(f"{req.rid}: a tree page in its window has no SWA KV")
        pins.update(pinned.tolist())
    expected = np.zeros(allocator.num_pages + 1, dtype=np.int64)
    if pins:
        expected[list(pins)] = list(pins.values())
    if not np.array_equal(expected, tree.pins()):
        problems.append("tree SWA pins disagree with the requests' windows")

    swa_owners = np.array(allocator.swa.owners())
    held = int((swa_owners[1:] > 0).sum()) * ps
    in_tree = int((swa_owners[1:] == OWNER_TREE).sum()) * ps
    total = pool.swa_available_size() + in_tree + held
    if in_tree != tree.swa_total_size():
        problems.append(f"SWA: the tree's counter says {tree.swa_total_size()}, it holds {in_tree}")
    if total != pool.swa_capacity:
        problems.append(
            f"SWA: available {pool.swa_available_size()} + tree {in_tree} + held {held} != "
            f"capacity {pool.swa_capacity}"
        )
    if pool.swa_evictable_size() + pool.swa_protected_size() != in_tree:
        problems.append("SWA: evictable + protected != the tree's SWA tokens")
    if idle and pool.swa_available_size() + pool.swa_evictable_size() != pool.swa_capacity:
        problems.append("idle but SWA available + evictable != SWA capacity")


def _check_mapping(allocator: SWAPageAllocator, problems: list[str]) -> None:
    swa = allocator.swa
    f2s = np.asarray(allocator.full_to_swa_page, dtype=SLOT_DTYPE)
    owners = np.array(allocator.owners())
    swa_owners = np.array(swa.owners())
    free_list = np.array(swa.free_page_list(), dtype=SLOT_DTYPE)
    if np.unique(free_list).size != free_list.size or free_list.size != int(
        (swa_owners == OWNER_FREE).sum()
    ):
        problems.append("SWA free list and owner tags disagree")
    if free_list.size and (swa_owners[free_list] != OWNER_FREE).any():
        problems.append("SWA free list holds a page in use")
    if swa.num_pending_pages or (swa_owners == OWNER_PENDING).any():
        problems.append("SWA pages pending behind a copy (no copy reads the SWA pool)")
    if f2s[0]:
        problems.append("full_to_swa_page maps the padding page")
    mapped = np.flatnonzero(f2s)
    targets = f2s[mapped]
    if (targets < 1).any() or (targets > swa.num_pages).any():
        problems.append("full_to_swa_page maps outside the SWA pool")
        return
    if np.unique(targets).size != targets.size:
        problems.append("an SWA page is mapped by two full pages")
    if ((owners[mapped] == OWNER_FREE) | (owners[mapped] == OWNER_PENDING)).any():
        problems.append("a free full page still maps an SWA page")
    if (swa_owners[targets] != owners[mapped]).any():
        problems.append("an SWA page's owner is not its full page's")
    in_use = int(((swa_owners[1:] != OWNER_FREE) & (swa_owners[1:] != OWNER_PENDING)).sum())
    if in_use != targets.size:
        problems.append(f"{in_use} SWA pages in use, {targets.size} mapped (a leak)")
