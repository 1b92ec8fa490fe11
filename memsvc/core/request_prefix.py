"""Each open request's prefix in the cache: matched in over the tiers, handed back out.

Part of the pool (:class:`~memsvc.core.pool.KVPool` owns one and shares its
open requests with it); everything that moves slots between a request's row
and the prefix cache, keeping locks and page owner tags straight, is here::

    match     the longest cached prefix is locked and written into the row
    publish   the row's page-aligned KV goes into the tree; the row runs on the tree's copy
    hand back the request closes: its KV is inserted (or freed) and its lock released

With the hierarchical cache the off-device part of a matched prefix is being
copied onto the device, and the request's next ``alloc_extend`` waits for
those loads (:meth:`RequestPrefixes.settle`). A load that met a page failing
verification is a miss for the requests holding that node alone: each is cut
back to its last good node (its row keeps the good prefix, locked, and
nothing else), the rest of the node is dropped from every tier, and
``settle`` tells each cut request its prefix length once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.allocator import OWNER_TREE, SLOT_DTYPE, PageAllocator
from memsvc.core.errors import IntegrityError, InvalidArgumentError

if TYPE_CHECKING:
    from memsvc.core.fence import CopyFence
    from memsvc.core.pool import ReqKV
    from memsvc.core.prefix_cache import PrefixCache
    from memsvc.core.radix_cache import TreeNode
    from memsvc.core.req_to_token import ReqToTokenTable


# A namespace's match counters (KVPool.namespace_stats): tokens each tier matched, all
# tiers together, and tokens looked up.
NAMESPACE_HIT_KEYS = (
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "matched_tokens",
    "lookup_tokens",
)
# Namespaces whose match counters are kept at most: past it, those with nothing cached
# are forgotten (else the oldest), so many short-lived tenants cannot grow memsvc.
MAX_NAMESPACE_HITS = 4096


@dataclass(frozen=True)
class TierMatch:
    """A prefix match over the tiers: ``prefix_len`` = device + host + storage tokens."""

    prefix_len: int
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    load_pending: bool  # a copy may still be filling the loaded pages


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(token_ids, dtype=np.int64)
    if array.ndim != 1:
        raise InvalidArgumentError(f"token ids must be one-dimensional, got shape {array.shape}")
    return array


class RequestPrefixes:
    """The pool's requests' side of the prefix cache (see the module docstring)."""

    def __init__(
        self,
        tree: PrefixCache,
        table: ReqToTokenTable,
        allocator: PageAllocator,
        reqs: dict[str, ReqKV],
    ) -> None:
        self.tree = tree
        self.table = table
        self.allocator = allocator
        self._reqs = reqs  # the pool's open requests (shared): a failed load may cut any
        # rid -> (node, copy) loading its matched prefix: alloc_extend waits for them.
        self._loading: dict[str, list[tuple[TreeNode, CopyFence]]] = {}
        # rid -> the prefix length it holds since a failed load cut it back, until it is told
        self._cut: dict[str, int] = {}
        # namespace -> tokens matched (per tier) and looked up, since the start
        self.namespace_hits: dict[str, dict[str, int]] = {}

    @property
    def num_loading(self) -> int:
        """Requests whose matched prefix has loads not yet waited for."""
        return len(self._loading)

    @property
    def busy(self) -> bool:
        """Some request has loads to wait for, or a cut it has not been told of."""
        return bool(self._loading or self._cut)

    # -- in ----------------------------------------------------------------------------

    def match(self, req: ReqKV, tokens: np.ndarray) -> TierMatch:
        """Lock the longest prefix of ``tokens`` in any tier for ``req`` (holding no KV)
        and write it into its row; its off-device part is loading."""
        for _ in range(len(tokens) // self.tree.page_size + 1):
            match = self.tree.match_and_load(tokens, req.namespace)
            failed = [n for n, f in match.loads if f.done() and f.error() is not None]
            if not failed:
                break
            self._cut_failed(failed)  # a load that failed earlier: cut it, match again
        self.tree.lock(match.last_node)
        self.table.write(req.row, 0, match.slots)
        req.last_node = match.last_node
        req.kv_len = req.protected_len = int(match.slots.size)
        if match.loads:
            self._loading[req.rid] = match.loads
        hits = self.namespace_hits.get(req.namespace)
        if hits is None:
            if len(self.namespace_hits) >= MAX_NAMESPACE_HITS:
                self._forget_hits()
            hits = self.namespace_hits[req.namespace] = dict.fromkeys(NAMESPACE_HIT_KEYS, 0)
        hits["device_hit_tokens"] += match.device_tokens
        hits["host_hit_tokens"] += match.host_tokens
        hits["storage_hit_tokens"] += match.storage_tokens
        hits["matched_tokens"] += req.kv_len
        hits["lookup_tokens"] += int(tokens.size)
        return TierMatch(
            req.kv_len,
            match.device_tokens,
            match.host_tokens,
            match.storage_tokens,
            match.load_pending,
        )

    def _forget_hits(self) -> None:
        """Make room in :attr:`namespace_hits`: drop the namespaces with nothing cached
        (the default one stays), else the oldest one."""
        cached = self.tree.namespace_tokens()
        idle = [ns for ns in self.namespace_hits if ns and ns not in cached]
        for ns in idle or [next(ns for ns in self.namespace_hits if ns)]:
            del self.namespace_hits[ns]

    def settle(self, rids: Iterable[str]) -> dict[str, int]:
        """Wait for the loads of ``rids``' matched prefixes; return those of ``rids``
        whose prefix was cut back since their match, with the length each holds now."""
        rids = list(rids)
        failed = []
        for rid in rids:
            for node, fence in self._loading.pop(rid, ()):
                if self.tree.wait_load(node, fence):
                    failed.append(node)
        if failed:
            self._cut_failed(failed)
        return {rid: self._cut.pop(rid) for rid in rids if rid in self._cut}

    def _cut_failed(self, nodes: list[TreeNode]) -> None:
        """Nodes whose load failed: keep each one's verified pages, cut every request
        holding the rest back to the last good node, drop the rest from every tier."""
        tree = self.tree
        bad = {id(n): n for n in tree.failed_loads_above(nodes)}
        for req in self._reqs.values():
            top, at = None, req.last_node
            while at is not None and at is not tree.root:
                if id(at) in bad:
                    top = at
                at = at.parent
            if top is not None:
                self._cut_back(req, top.parent)
        tree.discard_failed(bad.values())
        for rid, loads in list(self._loading.items()):
            self._loading[rid] = [(n, f) for n, f in loads if id(n) not in bad]

    def _cut_back(self, req: ReqKV, last_node: TreeNode) -> None:
        """Cut ``req``'s matched prefix back to end at ``last_node`` (an ancestor)."""
        if req.kv_len != req.protected_len:
            raise IntegrityError(f"{req.rid!r} ran an extend over a load that failed")
        prefix_len = int(self.tree.path_key(last_node).size)
        self.tree.lock(last_node)
        self.tree.unlock(req.last_node)
        self.table.write(req.row, prefix_len, np.zeros(req.kv_len - prefix_len, dtype=SLOT_DTYPE))
        req.kv_len = req.protected_len = prefix_len
        req.last_node = last_node
        self._cut[req.rid] = prefix_len

    # -- out ---------------------------------------------------------------------------

    def publish(self, req: ReqKV, token_ids: Sequence[int] | np.ndarray) -> int:
        """Put ``req``'s page-aligned KV into the tree; its row runs on the tree's copy.

        Returns the new protected (tree-owned) prefix length.
        """
        tokens = self.committed_tokens(req, token_ids)
        self._drop_reservation(req, tokens.size)
        kv_slots = self.table.read(req.row, 0, req.kv_len)
        cached = self.tree.cache_unfinished_req(
            tokens, kv_slots, req.protected_len, req.last_node, namespace=req.namespace
        )
        self._hand_to_tree(req, kv_slots[req.protected_len : cached.protected_len])
        self.table.write(req.row, req.protected_len, cached.slots[req.protected_len :])
        req.protected_len, req.last_node = cached.protected_len, cached.last_node
        return req.protected_len

    def hand_back(
        self, req: ReqKV, token_ids: Sequence[int] | np.ndarray | None, *, is_insert: bool
    ) -> None:
        """``req`` closes: insert its KV into the tree (``is_insert``) or free what the
        tree does not own, and release its lock. Its row is the pool's to clear."""
        # Its loads need no waiting now (pages it frees stay pending behind the copy).
        if self._loading:
            self._loading.pop(req.rid, None)
        self._cut.pop(req.rid, None)
        if is_insert:
            if token_ids is None:
                raise InvalidArgumentError("release with is_insert=True needs the token ids")
            tokens = self.committed_tokens(req, token_ids)
            self._drop_reservation(req, tokens.size)
        else:
            tokens = np.zeros(req.kv_len, dtype=np.int64)  # only the length matters
        kv_slots = self.table.read(req.row, 0, req.kv_len)
        self.tree.cache_finished_req(
            tokens,
            kv_slots,
            req.protected_len,
            req.last_node,
            is_insert=is_insert,
            namespace=req.namespace,
        )
        if is_insert:
            self._hand_to_tree(req, kv_slots[req.protected_len :])

    def check_tree_tokens(self, req: ReqKV, token_ids: Sequence[int] | np.ndarray) -> None:
        """Raise unless ``token_ids`` can be inserted for ``req`` (its KV's length, and
        its locked prefix's tokens first)."""
        tokens = self.committed_tokens(req, token_ids)
        locked = self.tree.path_key(req.last_node)
        if not np.array_equal(tokens[: locked.size], locked):
            raise InvalidArgumentError(
                f"token ids of {req.rid!r} differ from the cached prefix it holds"
            )

    def committed_tokens(self, req: ReqKV, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The token ids of ``req``'s written KV: one per position, or one fewer when the
        last position is a decode slot reserved ahead and not written yet (the overlap
        scheduler reserves step t+1's slot while step t runs; a request that finished
        at step t hands it back unwritten)."""
        tokens = as_token_array(token_ids)
        kv_len = req.kv_len
        if tokens.size != kv_len and not (tokens.size == kv_len - 1 >= req.protected_len):
            raise InvalidArgumentError(
                f"{req.rid!r} has KV for {kv_len} tokens, got {tokens.size} token ids"
            )
        return tokens

    def _drop_reservation(self, req: ReqKV, written: int) -> None:
        """Free ``req``'s positions past ``written`` (at most the one reserved ahead,
        see :meth:`committed_tokens`): its slot, and its page if the slot opened one."""
        if written == req.kv_len:
            return
        slot = self.table.read(req.row, written, written + 1)
        if written % self.tree.page_size == 0:
            self.allocator.free(slot, owner=req.row)
        self.table.write(req.row, written, np.zeros(1, dtype=SLOT_DTYPE))
        req.kv_len = written

    def _hand_to_tree(self, req: ReqKV, slots: np.ndarray) -> None:
        """Pages of ``slots`` that the request still owns after an insert now belong to the tree."""
        if not slots.size:
            return
        page_size = self.tree.page_size
        pages = np.unique(slots // page_size)
        owners = self.allocator.owners()[pages]
        # Duplicates were freed by the tree and the unaligned tail stays the
        # request's (or was freed): what the request still owns here was inserted.
        self.allocator.set_owner(pages[owners == req.row], OWNER_TREE, expected=req.row)
