"""The host store of a hybrid (sliding-window) model: full KV and the SWA window's KV.

An offloaded request needs, to run on, every position's full-attention KV and
the sliding-window layers' KV of its last ``W`` positions only (its SWA tail,
page aligned as the radix cache's match rule)::

    row        0 ............................ swa_from ............. num_tokens
    full KV    |<----------------------- stored ------------------------->|
    SWA KV     |   (freed / never needed)    |<-------- stored ---------->|
               swa_from = floor_page(max(0, num_tokens - W))

So a :class:`HybridHostStore` is two :class:`HostStore` arenas under one name
per request: the full pool's (``kv``) and the SWA pool's (``swa_kv``, through
:class:`SWABuffersView`), the byte budget split between them as the device
pools split theirs. It answers the :class:`HostStore` API the pool, the
handlers and the integrity check use (sizes are both arenas together), and
:meth:`swa_from` says where an entry's SWA part starts. The SWA copies are
synchronous (a window's few pages; the SWA pool has no pending pages), the
full ones asynchronous where asked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE
from memsvc.core.backends.base import HostPageCopies, KVBuffers
from memsvc.core.errors import HostStoreFullError, InvalidArgumentError
from memsvc.core.fence import CopyFence
from memsvc.core.host_store import HostStore
from memsvc.core.layout import PoolLayout
from memsvc.core.swa_radix_cache import swa_tail_start


def swa_pool_layout(layout: PoolLayout) -> PoolLayout:
    """The SWA pool of a hybrid ``layout`` seen as a plain (one-pool) layout."""
    return PoolLayout(
        num_layers=layout.num_swa_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        page_size=layout.page_size,
        num_pages=layout.swa_num_pages,
        dtype=layout.dtype,
        max_running_requests=layout.max_running_requests,
        max_context_len=layout.max_context_len,
    )


class SWABuffersView(HostPageCopies, KVBuffers):
    """The SWA pool's buffer (``swa_kv``) with the page copies a :class:`HostStore` uses.

    Owns nothing: ``swa_kv`` stays its backend's (closed with it). Slots here are
    SWA-pool slots (``swa_page * page_size + offset``).
    """

    def __init__(self, buffers: KVBuffers) -> None:
        if buffers.swa_kv is None:
            raise InvalidArgumentError("SWABuffersView of a layout without sliding layers")
        if not isinstance(buffers.swa_kv, np.ndarray):
            raise InvalidArgumentError("the host store's SWA arena needs a host (shm) SWA pool")
        self.layout = swa_pool_layout(buffers.layout)
        self.kv = buffers.swa_kv
        self.req_to_token = buffers.req_to_token

    def handle(self) -> dict[str, Any]:
        raise InvalidArgumentError("SWABuffersView has no handle (attach the pool's buffers)")

    def write_row(self, row: int, start: int, values: np.ndarray) -> None:
        raise InvalidArgumentError("SWABuffersView has no req_to_token of its own")

    def write_cells(self, rows: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        raise InvalidArgumentError("SWABuffersView has no req_to_token of its own")

    def close(self) -> None:
        """Nothing to release (the backend owns ``swa_kv``)."""


def split_host_bytes(layout: PoolLayout, capacity_bytes: int) -> tuple[int, int]:
    """The host store's bytes for the full and the SWA arena, as the device pools split."""
    full = layout.num_pages * layout.bytes_per_page
    swa = layout.swa_num_pages * layout.swa_bytes_per_page
    full_share = capacity_bytes * full // (full + swa)
    return full_share, capacity_bytes - full_share


class HybridHostStore:
    """Two host arenas (full, SWA) under one request name; see the module docstring."""

    def __init__(self, buffers: KVBuffers, capacity_bytes: int) -> None:
        layout = buffers.layout
        assert buffers.full_to_swa_page is not None and layout.is_hybrid
        full_bytes, swa_bytes = split_host_bytes(layout, max(capacity_bytes, 0))
        if capacity_bytes < 0:
            full_bytes = capacity_bytes  # HostStore refuses it by name
        self.full = HostStore(buffers, full_bytes)
        self.swa = HostStore(SWABuffersView(buffers), swa_bytes)
        self._f2s = buffers.full_to_swa_page
        self._page_size = layout.page_size
        self.sliding_window = layout.sliding_window

    # -- sizes (both arenas) -----------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.full.capacity_bytes + self.swa.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.full.used_bytes + self.swa.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.full.free_bytes + self.swa.free_bytes

    def free_extents(self) -> list[tuple[int, int]]:
        return self.full.free_extents()

    def __contains__(self, rid: str) -> bool:
        return rid in self.full

    def __len__(self) -> int:
        return len(self.full)

    def rids(self) -> list[str]:
        return self.full.rids()

    def entry_bytes(self, rid: str) -> int:
        return self.full.entry_bytes(rid) + self.swa.entry_bytes(rid)

    def num_tokens(self, rid: str) -> int:
        return self.full.num_tokens(rid)

    def swa_from(self, rid: str) -> int:
        """First position whose SWA KV ``rid``'s entry holds (page aligned)."""
        return self.full.num_tokens(rid) - self.swa.num_tokens(rid)

    def swa_tail_start(self, num_tokens: int) -> int:
        return swa_tail_start(num_tokens, self.sliding_window, self._page_size)

    def bytes_needed(self, num_tokens: int) -> int:
        swa_tokens = num_tokens - self.swa_tail_start(num_tokens)
        return self.full.bytes_needed(num_tokens) + self.swa.bytes_needed(swa_tokens)

    # -- copies ---------------------------------------------------------------------

    def swa_slots(self, token_slots: np.ndarray) -> np.ndarray:
        """The SWA-pool slots of full-pool ``token_slots`` (each page must have its SWA page)."""
        ps = self._page_size
        slots = np.asarray(token_slots, dtype=SLOT_DTYPE)
        swa_pages = self._f2s[slots // ps].astype(SLOT_DTYPE)
        if slots.size and not swa_pages.all():
            raise InvalidArgumentError("a page of the SWA window has no SWA page (freed?)")
        return swa_pages * ps + slots % ps

    def offload(
        self,
        rid: str,
        token_slots: np.ndarray,
        *,
        asynchronous: bool = False,
        swa_from: int | None = None,
    ) -> int:
        """Copy every position's full KV and the SWA KV from ``swa_from`` on (default: the
        SWA tail of ``token_slots.size`` tokens) out; returns the bytes. All or nothing."""
        num_tokens = int(token_slots.size)
        swa_from = self.swa_tail_start(num_tokens) if swa_from is None else swa_from
        if swa_from % self._page_size or not 0 <= swa_from <= num_tokens:
            raise InvalidArgumentError(f"swa_from {swa_from} is off for {num_tokens} tokens")
        swa_slots = self.swa_slots(token_slots[swa_from:])
        full_needed = self.full.bytes_needed(num_tokens)
        swa_needed = self.swa.bytes_needed(swa_slots.size)
        if full_needed > self.full.free_bytes or swa_needed > self.swa.free_bytes:
            raise HostStoreFullError(
                f"host store full: {rid!r} needs {full_needed} + {swa_needed} (SWA) bytes, "
                f"{self.full.free_bytes} + {self.swa.free_bytes} free"
            )
        nbytes = self.swa.offload(rid, swa_slots)  # synchronous: SWA pages may go at once
        try:
            nbytes += self.full.offload(rid, token_slots, asynchronous=asynchronous)
        except BaseException:
            self.swa.discard(rid)
            raise
        return nbytes

    def fence(self, rid: str) -> CopyFence:
        return self.full.fence(rid)

    def load(self, rid: str, new_token_slots: np.ndarray) -> int:
        """Copy both parts back (the SWA part into the SWA pages ``full_to_swa_page`` gives
        the new slots from :meth:`swa_from` on) and drop the entry; returns the bytes."""
        swa_from = self.swa_from(rid)
        swa_slots = self.swa_slots(np.asarray(new_token_slots)[swa_from:])
        try:
            nbytes = self.full.load(rid, new_token_slots)
        except BaseException:
            if rid not in self.full and rid in self.swa:  # a failed copy dropped the full part
                self.swa.discard(rid)
            raise
        return nbytes + self.swa.load(rid, swa_slots)

    def read(self, rid: str) -> np.ndarray:
        """The stored full KV (``[tokens, full layers, 2, heads, dim]``; for tests)."""
        return self.full.read(rid)

    def pages(self, rid: str) -> tuple[int, np.ndarray]:
        """``rid``'s token count and its full pages (:meth:`HostStore.pages`)."""
        return self.full.pages(rid)

    def window_pages(self, rid: str) -> tuple[int, np.ndarray]:
        """Where ``rid``'s SWA part starts and its SWA pages, in token order (a copy: what
        a migration sends beside :meth:`pages`)."""
        return self.swa_from(rid), self.swa.pages(rid)[1]

    def read_swa(self, rid: str) -> np.ndarray:
        """The stored SWA KV from :meth:`swa_from` on (``[tokens, swa layers, 2, heads, dim]``)."""
        return self.swa.read(rid)

    def zero_on_discard(self, rid: str) -> None:
        self.full.zero_on_discard(rid)
        self.swa.zero_on_discard(rid)

    def discard(self, rid: str) -> None:
        self.full.discard(rid)
        self.swa.discard(rid)
