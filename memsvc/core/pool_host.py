"""The KVPool's host-store ops: ``offload``, ``load`` and ``host_discard``.

A mixin of :class:`~memsvc.core.pool.KVPool` (it uses the pool's request
table, allocator and host store): a request's KV copied to the host store
(a retract victim's, or on request) and back into fresh slots of its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.allocator import ceil_div, extend_slots
from memsvc.core.errors import InvalidArgumentError
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_host_store import HybridHostStore

if TYPE_CHECKING:
    from memsvc.core.allocator import PageAllocator
    from memsvc.core.host_store import HostStore
    from memsvc.core.layout import PoolLayout
    from memsvc.core.pool import ReqKV
    from memsvc.core.prefix_cache import PrefixCache
    from memsvc.core.req_to_token import ReqToTokenTable
    from memsvc.core.scrub import ZeroFreedKV
    from memsvc.core.swa_window import SWAWindows


class HostStoreOps:
    """See the module docstring."""

    async_offload: bool
    layout: PoolLayout
    allocator: PageAllocator
    host_store: HostStore | HybridHostStore
    table: ReqToTokenTable
    swa: SWAWindows | None
    tree: PrefixCache

    if TYPE_CHECKING:
        scrub: ZeroFreedKV | None

        def request(self, rid: str) -> ReqKV: ...
        def evict_swa(self, num_tokens: int) -> int: ...
        def alloc_extend(
            self, items: Sequence[tuple[str, int]], *, evict: bool = True
        ) -> np.ndarray | None: ...

    def offload(self, rid: str, num_tokens: int | None = None) -> int:
        """Copy the KV of the first ``num_tokens`` positions of ``rid`` to the host store."""
        req = self.request(rid)
        num_tokens = req.kv_len if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= req.kv_len:
            raise InvalidArgumentError(
                f"cannot offload {num_tokens} tokens of {rid!r}, which has {req.kv_len}"
            )
        slots = self.table.read(req.row, 0, num_tokens)
        if isinstance(self.host_store, HybridHostStore):
            # every position's full KV, the SWA KV of the window still to run alone
            assert self.swa is not None
            # from the SWA tail (SGLang's _swa_tail_len), or where the held SWA KV starts if
            # later; the query at num_tokens reads from num_tokens - W + 1 (the frontier)
            evicted = int(self.swa.evicted_lens[req.row])
            swa_from = max(self.host_store.swa_tail_start(num_tokens), evicted)
            if swa_from > int(self.swa.frontier(np.array([num_tokens]))[0]):
                raise InvalidArgumentError(
                    f"cannot offload {num_tokens} tokens of {rid!r}: the SWA KV of their "
                    f"window is freed (held from {evicted})"
                )
            nbytes = self.host_store.offload(
                rid, slots, asynchronous=self.async_offload, swa_from=swa_from
            )
        else:
            nbytes = self.host_store.offload(rid, slots, asynchronous=self.async_offload)
        if self.scrub is not None and req.namespace:
            self.host_store.zero_on_discard(rid)  # --zero-freed-kv: a salted request's KV
        if self.async_offload:
            self.allocator.copy_issued(self.host_store.fence(rid))
        return nbytes

    def load(self, rid: str, *, evict: bool = True) -> np.ndarray | None:
        """Bring ``rid``'s offloaded KV back into fresh slots of its (empty) row.

        Returns the slots, or ``None`` (nothing changed) when the pool has no room.
        """
        req = self.request(rid)
        if req.kv_len:
            raise InvalidArgumentError(f"load needs an empty row; {rid!r} holds {req.kv_len}")
        if isinstance(self.host_store, HybridHostStore):
            return self._load_hybrid(req, self.host_store, evict=evict)
        num_tokens = self.host_store.num_tokens(rid)
        slots = self.alloc_extend([(rid, num_tokens)], evict=evict)
        if slots is not None:
            self.host_store.load(rid, slots)
        return slots

    def _load_hybrid(self, req: ReqKV, store: HybridHostStore, *, evict: bool) -> np.ndarray | None:
        """:meth:`load` of a hybrid model: full pages for every position, SWA pages for the
        stored window alone (each pool's shortfall evicted first), the window restored."""
        assert isinstance(self.allocator, SWAPageAllocator) and self.swa is not None
        num_tokens, swa_from = store.num_tokens(req.rid), store.swa_from(req.rid)
        ps = self.layout.page_size
        num_pages = ceil_div(num_tokens, ps)
        num_swa_pages = num_pages - swa_from // ps
        if evict:
            full_shortfall = num_pages * ps - self.allocator.full_available_size()
            if full_shortfall > 0:
                self.tree.evict(full_shortfall)
            swa_shortfall = num_swa_pages * ps - self.allocator.swa_available_size()
            if swa_shortfall > 0:
                self.evict_swa(swa_shortfall)
        pages = self.allocator.alloc_pages_swa_tail(num_pages, num_swa_pages, owner=req.row)
        if pages is None:
            return None
        slots = extend_slots(pages, ps, 0, num_tokens, 0)
        self.table.write(req.row, 0, slots)
        req.kv_len = num_tokens
        self.swa.loaded(req.row, swa_from, num_tokens)
        store.load(req.rid, slots)
        return slots

    def host_discard(self, rid: str) -> None:
        self.host_store.discard(rid)
