"""The KV pool's integrity check: every page in exactly one place, every counter right.

Used by every test that touches memory and by memsvc's ``check`` op::

    page owner tags  ==  free list  +  pending (freed, waiting for a copy)
                         +  radix tree nodes  +  each open request's own pages
    available + evictable + protected + held == capacity
    a node's lock_ref == the open requests whose locked prefix passes through it
    idle:  nothing open, nothing protected, host store empty
    hicache: the tree's check covers the host and storage tiers (each page in one
             node, bytes accounted); idle adds the storage files == the tree's index
    eviction: every candidate of each tier (free device leaf, evictable host or
             storage copy) is in that tier's eviction heap at its current rank
             (the tree's check; memsvc/core/evict_heap.py)
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.allocator import OWNER_FREE, OWNER_PENDING, OWNER_TREE, SLOT_DTYPE
from memsvc.core.errors import IntegrityError
from memsvc.core.swa_check import check_swa
from memsvc.core.swa_host_store import HybridHostStore

if TYPE_CHECKING:
    from memsvc.core.pool import KVPool
    from memsvc.core.radix_cache import TreeNode


def check_pool(pool: KVPool, *, idle: bool = False) -> None:
    """Raise :class:`IntegrityError` listing everything that is wrong."""
    problems: list[str] = []
    page_size = pool.page_size
    owners = np.array(pool.allocator.owners())
    num_pages = pool.layout.num_pages

    free_list = np.array(pool.allocator.free_page_list(), dtype=SLOT_DTYPE)
    if np.unique(free_list).size != free_list.size:
        problems.append("a page is on the free list twice")
    if free_list.size != int((owners == OWNER_FREE).sum()) or (
        free_list.size and (owners[free_list] != OWNER_FREE).any()
    ):
        problems.append("free list and owner tags disagree")
    pending = np.array(pool.allocator.pending_page_list(), dtype=SLOT_DTYPE)
    if np.intersect1d(pending, free_list).size or np.unique(pending).size != pending.size:
        problems.append("a pending page is also free, or pending twice")
    if pending.size != int((owners == OWNER_PENDING).sum()) or (
        pending.size and (owners[pending] != OWNER_PENDING).any()
    ):
        problems.append("pending pages and owner tags disagree")
    if pending.size != pool.allocator.num_pending_pages:
        problems.append("pending page counter disagrees with the pending list")

    # The tree: every node's pages are tree-owned, no page in two nodes.
    try:
        pool.tree.check()
    except IntegrityError as exc:
        problems.append(f"radix tree: {exc}")
    tree_pages = [node.value[::page_size] // page_size for node in pool.tree.iter_nodes()]
    tree_pages_all = np.concatenate(tree_pages) if tree_pages else np.empty(0, SLOT_DTYPE)
    if np.unique(tree_pages_all).size != tree_pages_all.size:
        problems.append("a page is in two tree nodes")
    if tree_pages_all.size != int((owners == OWNER_TREE).sum()) or (
        tree_pages_all.size and (owners[tree_pages_all] != OWNER_TREE).any()
    ):
        problems.append("tree nodes and owner tags disagree")
    if tree_pages_all.size * page_size != pool.tree.total_size():
        problems.append("tree size counter disagrees with its nodes")

    # Requests: own pages tagged with their row, prefix pages tree-owned, locks exact.
    expected_locks: Counter[int] = Counter()
    nodes_by_id: dict[int, TreeNode] = {id(n): n for n in pool.tree.iter_nodes()}
    live_rows = set()
    for req in (pool.request(rid) for rid in pool.open_rids()):
        live_rows.add(req.row)
        if req.protected_len % page_size or req.protected_len > req.kv_len:
            problems.append(f"{req.rid}: protected_len {req.protected_len} is off")
            continue
        slots = pool.table.read(req.row, 0, req.kv_len)
        prefix_pages = slots[: req.protected_len : page_size] // page_size
        own_pages = np.unique(slots[req.protected_len :] // page_size)
        if prefix_pages.size and (owners[prefix_pages] != OWNER_TREE).any():
            problems.append(f"{req.rid}: locked prefix is not tree-owned")
        if own_pages.size and (owners[own_pages] != req.row).any():
            problems.append(f"{req.rid}: holds pages it does not own")
        if own_pages.size != int((owners == req.row).sum()):
            problems.append(f"{req.rid}: owns pages outside its row (leak)")
        node = req.last_node
        if node is not pool.tree.root and node.namespace != req.namespace:
            problems.append(f"{req.rid}: holds a prefix of another cache namespace")
        while node is not pool.tree.root and node is not None:
            expected_locks[id(node)] += 1
            node = node.parent
    stray = set(np.unique(owners[1:][owners[1:] > 0]).tolist()) - live_rows
    if stray:
        problems.append(f"pages owned by closed rows {sorted(stray)[:8]}")
    if ((owners[1:] < OWNER_TREE) & (owners[1:] != OWNER_PENDING)).any():
        problems.append("pages with an anonymous or reserved owner")
    for node_id, node in nodes_by_id.items():
        if node.lock_ref != expected_locks.get(node_id, 0):
            problems.append(
                f"tree node lock_ref {node.lock_ref} != {expected_locks.get(node_id, 0)} "
                "locks held by open requests"
            )
            break
    if set(pool.table.rows_in_use().tolist()) != live_rows:
        problems.append("req_to_token rows in use do not match open requests")

    held = int((owners[1:] > 0).sum()) * page_size
    available = pool.full_available_size()  # available_size() unless hybrid (min of the pools)
    total = available + pool.evictable_size() + pool.protected_size() + held
    if total != num_pages * page_size:
        problems.append(
            f"available {available} + evictable {pool.evictable_size()} + "
            f"protected {pool.protected_size()} + held {held} != capacity {pool.capacity}"
        )
    # a hybrid model's host store: two arenas (full KV, SWA window KV), one entry in each
    stores = [pool.host_store]
    if isinstance(pool.host_store, HybridHostStore):
        stores = [pool.host_store.full, pool.host_store.swa]
        if sorted(stores[0].rids()) != sorted(stores[1].rids()):
            problems.append("host store: the full and SWA arenas hold different requests")
    for store in stores:
        host_bytes = sum(store.entry_bytes(rid) for rid in store.rids())
        listed_free = sum(n for _, n in store.free_extents()) * store.bytes_needed(page_size)
        if (
            host_bytes != store.used_bytes
            or host_bytes > store.capacity_bytes
            or listed_free != store.free_bytes
        ):
            problems.append("host store byte accounting is off")

    if idle:
        if pool.num_loading:
            problems.append(f"idle but {pool.num_loading} prefix loads are tracked")
        try:
            pool.tree.check_idle()
        except IntegrityError as exc:
            problems.append(str(exc))
        if pool.open_rids():
            problems.append(f"idle but {len(pool.open_rids())} requests are open")
        if pool.protected_size():
            problems.append(f"idle but protected = {pool.protected_size()}")
        if available + pool.evictable_size() != pool.capacity:
            problems.append("idle but available + evictable != capacity")
        if len(pool.host_store):
            problems.append(f"idle but the host store holds {len(pool.host_store)} entries")
    if pool.swa is not None:
        check_swa(pool, problems, idle=idle)
    if problems:
        raise IntegrityError("; ".join(problems))
