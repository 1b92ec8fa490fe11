"""The KVPool's host-store ops: ``offload``, ``load`` and ``host_discard``.

A mixin of :class:`~memsvc.core.pool.KVPool` (it uses the pool's request
table, allocator and host store): a request's KV copied to the host store
(a retract victim's, or on request) and back into fresh slots of its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from memsvc.core.errors import InvalidArgumentError

if TYPE_CHECKING:
    from memsvc.core.allocator import PageAllocator
    from memsvc.core.host_store import HostStore
    from memsvc.core.layout import PoolLayout
    from memsvc.core.pool import ReqKV
    from memsvc.core.req_to_token import ReqToTokenTable


class HostStoreOps:
    """See the module docstring."""

    async_offload: bool
    layout: PoolLayout
    allocator: PageAllocator
    host_store: HostStore
    table: ReqToTokenTable

    if TYPE_CHECKING:

        def request(self, rid: str) -> ReqKV: ...
        def alloc_extend(
            self, items: Sequence[tuple[str, int]], *, evict: bool = True
        ) -> np.ndarray | None: ...

    def offload(self, rid: str, num_tokens: int | None = None) -> int:
        """Copy the KV of the first ``num_tokens`` positions of ``rid`` to the host store."""
        self._refuse_hybrid("offload")
        req = self.request(rid)
        num_tokens = req.kv_len if num_tokens is None else num_tokens
        if not 0 <= num_tokens <= req.kv_len:
            raise InvalidArgumentError(
                f"cannot offload {num_tokens} tokens of {rid!r}, which has {req.kv_len}"
            )
        slots = self.table.read(req.row, 0, num_tokens)
        nbytes = self.host_store.offload(rid, slots, asynchronous=self.async_offload)
        if self.async_offload:
            self.allocator.copy_issued(self.host_store.fence(rid))
        return nbytes

    def load(self, rid: str, *, evict: bool = True) -> np.ndarray | None:
        """Bring ``rid``'s offloaded KV back into fresh slots of its (empty) row.

        Returns the slots, or ``None`` (nothing changed) when the pool has no room.
        """
        self._refuse_hybrid("load")
        req = self.request(rid)
        if req.kv_len:
            raise InvalidArgumentError(f"load needs an empty row; {rid!r} holds {req.kv_len}")
        num_tokens = self.host_store.num_tokens(rid)
        slots = self.alloc_extend([(rid, num_tokens)], evict=evict)
        if slots is not None:
            self.host_store.load(rid, slots)
        return slots

    def _refuse_hybrid(self, what: str) -> None:
        # The host store copies the full pool's pages alone; a hybrid model's window
        # KV would be lost (issue 29, item 4 moves it).
        if self.layout.is_hybrid:
            raise InvalidArgumentError(
                f"{what}: the host store has no SWA pool yet (a hybrid sliding-window model)"
            )

    def host_discard(self, rid: str) -> None:
        self.host_store.discard(rid)
