"""Retract: release running requests, least worth keeping first, until the next decode step fits.

The memory half of SGLang's ``retract_decode``, run inside memsvc so that a
scheduler needs one round trip for it::

    rows = [keep most ... keep least]      pop from the end
    repeat (at least once when 2+ rows): release the last, evict remaining × steps
    until the step fits or one row is left  ->  last_does_not_fit tells the caller
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.errors import HostStoreFullError

if TYPE_CHECKING:
    from memsvc.core.pool import KVPool


@dataclass(frozen=True)
class RetractResult:
    retracted: list[str]  # released (and offloaded where asked), in retract order
    offload_failed: list[str]  # released without a host copy: the host store was full
    tokens_gained: int  # available + evictable after minus before
    last_does_not_fit: bool  # one request left and its next step still does not fit
    offloaded_bytes: int = 0  # copied to the host store for the retracted victims
    to_tree: list[str] = field(default_factory=list)  # of ``retracted``: KV kept in the tree
    tree_bytes: int = 0  # copied to the hicache host tier for them


def retract_until_fits(
    pool: KVPool,
    rows: Sequence[int] | np.ndarray,
    *,
    offload: bool | np.ndarray,
    retract_decode_steps: int,
    to_tree: dict[int, np.ndarray] | None = None,
) -> RetractResult:
    """Release requests from the end of ``rows`` until the next decode step fits.

    ``rows`` is the decode batch in the scheduler's victim order, most worth
    keeping first. At least one request is retracted when there are two or
    more, the last one never is; after each release the tree gives up
    ``remaining × retract_decode_steps`` tokens (the shortfall only) so the
    freed prefix is usable at once. With ``offload`` (a bool, or one per row) a
    victim's KV goes to the host store first; a victim the store cannot take
    is released all the same and reported in ``offload_failed`` (the scheduler
    decides: abort it or re-prefill it). A victim whose row is in ``to_tree``
    (row -> its committed token ids; hicache) is instead inserted into the
    radix tree and backed up to its host tier (:meth:`KVPool.release_to_tree`),
    so its re-admission finds its KV by a prefix match. Retracted requests are
    closed (their rows freed).
    """
    to_tree = to_tree or {}
    for row, tokens in to_tree.items():  # validated before anything changes
        pool.check_tree_tokens(pool.rid_of_row(row), tokens)
    order = pool.check_rows(np.asarray(rows)).tolist()
    to_host = dict.fromkeys(order, offload) if isinstance(offload, bool) else None
    if to_host is None:
        to_host = dict(zip(order, np.asarray(offload, dtype=bool).tolist(), strict=True))
    tokens_before = pool.available_size() + pool.evictable_size()
    retracted: list[str] = []
    offload_failed: list[str] = []
    offloaded_bytes = tree_bytes = 0
    tree_rids: list[str] = []
    first = True
    while first or not pool.check_decode_mem_rows(np.asarray(order, dtype=np.int64)):
        if len(order) <= 1:
            break
        first = False
        row = order.pop()
        rid = pool.rid_of_row(row)
        victims = retracted
        if row in to_tree:
            tree_bytes += pool.release_to_tree(rid, to_tree[row])
            retracted.append(rid)
            tree_rids.append(rid)
            pool.ensure_available(len(order) * retract_decode_steps)
            continue
        if to_host[row]:
            try:
                offloaded_bytes += pool.offload(rid)
            except HostStoreFullError:
                victims = offload_failed
        pool.release(rid, is_insert=False)
        victims.append(rid)
        pool.ensure_available(len(order) * retract_decode_steps)
    last_does_not_fit = len(order) <= 1 and not pool.check_decode_mem_rows(
        np.asarray(order, dtype=np.int64)
    )
    return RetractResult(
        retracted=retracted,
        offload_failed=offload_failed,
        tokens_gained=pool.available_size() + pool.evictable_size() - tokens_before,
        last_does_not_fit=last_does_not_fit,
        offloaded_bytes=offloaded_bytes,
        to_tree=tree_rids,
        tree_bytes=tree_bytes,
    )
