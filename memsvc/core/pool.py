"""KVPool: the memsvc core as one object (buffers, allocator, table, tree, host store).

The pool tracks each open request's KV as a row of ``req_to_token``::

    row:  | prefix owned by the tree (locked) | the request's own slots        |
          0                          protected_len                       kv_len

``protected_len`` is page-aligned (tree keys are), so every page the request
owns holds only its own tokens. Every page is in exactly one place: the free
list, the radix tree, or one request (its owner tag in the allocator says
which); :meth:`KVPool.check_integrity` verifies that and all the accounting.

Every method runs to completion and either succeeds or raises a typed
:class:`~memsvc.core.errors.MemsvcError` having changed nothing; allocation
that cannot be satisfied returns ``None``, also without changing anything.

The pool delegates to its parts: the prefix cache (``tree``, a
:class:`~memsvc.core.prefix_cache.PrefixCache`: :class:`RadixCache`, or
:class:`HiRadixCache` over the host and storage tiers), each request's side
of it (:mod:`memsvc.core.request_prefix`), batched decode rows
(:mod:`memsvc.core.decode_rows`) and retraction (:mod:`memsvc.core.retract`);
the host-store ops (offload, load, host_discard) are a mixin,
:class:`memsvc.core.pool_host.HostStoreOps`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memsvc.core.allocator import (
    SLOT_DTYPE,
    PageAllocator,
    extend_slots,
    num_new_pages,
)
from memsvc.core.backends import create_buffers
from memsvc.core.decode_rows import DecodeRows
from memsvc.core.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    OutOfRowsError,
    PrefixCutError,
    UnknownRequestError,
)
from memsvc.core.hicache import HiCacheConfig, HiRadixCache
from memsvc.core.host_store import HostStore
from memsvc.core.integrity import check_pool
from memsvc.core.layout import PoolLayout
from memsvc.core.pool_host import HostStoreOps
from memsvc.core.prefix_cache import PrefixCache
from memsvc.core.radix_cache import RadixCache, TreeNode, check_namespace
from memsvc.core.req_to_token import ReqToTokenTable
from memsvc.core.request_prefix import (
    NAMESPACE_HIT_KEYS,
    RequestPrefixes,
    TierMatch,
    as_token_array,
)
from memsvc.core.retract import RetractResult, retract_until_fits
from memsvc.core.scrub import ZeroFreedKV
from memsvc.core.swa_allocator import SWAPageAllocator
from memsvc.core.swa_hicache import SWAHiRadixCache
from memsvc.core.swa_host_store import HybridHostStore
from memsvc.core.swa_radix_cache import SWARadixCache
from memsvc.core.swa_window import SWAWindows
from memsvc.namespace import DEFAULT_NAMESPACE, namespace_label

NAMESPACE_STATS_TOP = 16  # namespaces the stats list, by device tokens cached


@dataclass
class ReqKV:
    """What the pool knows of one open request.

    ``kv_len`` lives in the pool's per-row array (shared here by reference) so
    that a decode step over a whole batch is a few vectorized numpy calls.
    """

    rid: str
    row: int
    last_node: TreeNode
    kv_lens: np.ndarray = field(repr=False)
    protected_len: int = 0  # leading positions whose slots the tree owns
    namespace: str = DEFAULT_NAMESPACE  # its cache namespace: every tree op for it uses it

    @property
    def kv_len(self) -> int:
        """Positions with a KV slot."""
        return int(self.kv_lens[self.row])

    @kv_len.setter
    def kv_len(self, value: int) -> None:
        self.kv_lens[self.row] = value


class KVPool(HostStoreOps):
    def __init__(
        self,
        layout: PoolLayout,
        *,
        backend: str = "shm",
        host_store_bytes: int = 0,
        disable_radix_cache: bool = False,
        backend_options: dict[str, Any] | None = None,
        async_offload: bool = False,
        hicache: HiCacheConfig | None = None,
        storage_seed: Callable[[str], str] | None = None,
        max_cached_tokens_per_namespace: int = 0,
        zero_freed_kv: bool = False,
    ) -> None:
        self.layout = layout
        # Offload copies return before they finish; freed pages wait for them.
        self.async_offload = async_offload
        self.buffers = create_buffers(layout, backend, **(backend_options or {}))
        # Hybrid (sliding-window) models: two pools, their tree and each request's window.
        self.swa: SWAWindows | None = None
        try:
            self.allocator: PageAllocator
            if layout.is_hybrid:
                self.allocator = SWAPageAllocator(
                    layout.num_pages,
                    layout.swa_num_pages,
                    layout.page_size,
                    self.buffers.full_to_swa_page,
                )
            else:
                self.allocator = PageAllocator(layout.num_pages, layout.page_size)
            self.table = ReqToTokenTable(self.buffers)
            # The pool goes through ``tree`` alone (a PrefixCache, whichever kind it is);
            # ``hicache`` is there for callers of the hierarchy's own API (tiers, stats).
            self.tree: PrefixCache
            self.hicache: HiRadixCache | None = None
            if hicache is not None and layout.is_hybrid:
                # host copies keep the SWA KV too (memsvc/core/swa_hicache.py)
                assert isinstance(self.allocator, SWAPageAllocator)
                if disable_radix_cache:
                    raise InvalidArgumentError(
                        "the hierarchical cache needs the radix cache (drop --disable-radix-cache)"
                    )
                self.tree = self.hicache = SWAHiRadixCache(
                    self.allocator,
                    self.buffers,
                    hicache,
                    layout.sliding_window,
                    storage_seed=storage_seed,
                )
                self.swa = SWAWindows(self.table, self.allocator, self.tree, layout.sliding_window)
            elif layout.is_hybrid:
                assert isinstance(self.allocator, SWAPageAllocator)
                self.tree = SWARadixCache(
                    self.allocator, layout.sliding_window, disabled=disable_radix_cache
                )
                self.swa = SWAWindows(self.table, self.allocator, self.tree, layout.sliding_window)
            elif hicache is not None:
                if disable_radix_cache:
                    raise InvalidArgumentError(
                        "the hierarchical cache needs the radix cache (drop --disable-radix-cache)"
                    )
                self.tree = self.hicache = HiRadixCache(
                    self.allocator, self.buffers, hicache, storage_seed=storage_seed
                )
            else:
                self.tree = RadixCache(self.allocator, disabled=disable_radix_cache)
            # a hybrid model's host store keeps the full KV and the SWA window's KV
            self.host_store: HostStore | HybridHostStore = (
                HybridHostStore(self.buffers, host_store_bytes)
                if layout.is_hybrid
                else HostStore(self.buffers, host_store_bytes)
            )
        except BaseException:
            self.buffers.close()
            raise
        # --zero-freed-kv: pages that held a salted request's KV are zeroed before reuse
        self.scrub = (
            ZeroFreedKV(self.allocator, self.buffers, self.table.num_rows)
            if zero_freed_kv
            else None
        )
        if zero_freed_kv and self.hicache is not None:
            self.hicache.zero_freed_host = True  # host-tier copies of salted nodes too
        self._reqs: dict[str, ReqKV] = {}
        self._rids_by_row: dict[int, str] = {}
        self._rows = DecodeRows(self.table, self.allocator)
        self._kv_lens = self._rows.kv_lens
        # Bumped whenever a request opens or closes: a batch of rows checked at
        # one generation is still valid while the generation is unchanged.
        self.rows_generation = 0
        # Requests' prefixes in the tree: matched in (with the loads alloc_extend waits
        # for, hicache), published, handed back.
        self._prefixes = RequestPrefixes(self.tree, self.table, self.allocator, self._reqs)
        # --max-cached-tokens-per-salt: each non-default namespace's device tokens
        self.tree.set_namespace_cap(max_cached_tokens_per_namespace)

    # -- sizes (tokens) --------------------------------------------------------

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def available_size(self) -> int:
        """Free tokens an allocation can have: ``min(full, swa)`` for a hybrid model."""
        return self.allocator.available_size()

    def evictable_size(self) -> int:
        """The tree's full-pool tokens in unlocked nodes."""
        return self.tree.evictable_size()

    # The pools one by one (a model without sliding layers has the full pool alone).

    def full_available_size(self) -> int:
        allocator = self.allocator
        if isinstance(allocator, SWAPageAllocator):
            return allocator.full_available_size()
        return allocator.available_size()

    @property
    def swa_capacity(self) -> int:
        """SWA pool token slots (0 without sliding layers)."""
        return self.layout.swa_capacity_tokens

    def swa_available_size(self) -> int:
        allocator = self.allocator
        return allocator.swa_available_size() if isinstance(allocator, SWAPageAllocator) else 0

    def swa_evictable_size(self) -> int:
        tree = self.tree
        return tree.swa_evictable_size() if isinstance(tree, SWARadixCache) else 0

    def swa_protected_size(self) -> int:
        tree = self.tree
        return tree.swa_protected_size() if isinstance(tree, SWARadixCache) else 0

    def swa_held_size(self) -> int:
        """SWA tokens on pages that live requests own."""
        tree = self.tree
        if not isinstance(tree, SWARadixCache):
            return 0
        return self.swa_capacity - self.swa_available_size() - tree.swa_total_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    @property
    def num_loading(self) -> int:
        """Requests whose matched prefix has loads not yet waited for (hicache)."""
        return self._prefixes.num_loading

    def held_size(self) -> int:
        """Tokens on pages that live requests own (not counting their locked tree prefix)."""
        return self.capacity - self.full_available_size() - self.tree.total_size()

    # -- requests --------------------------------------------------------------

    def open_request(self, rid: str, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Give ``rid`` a ``req_to_token`` row; returns the row. ``namespace``: the cache
        namespace its KV is shared in (:mod:`memsvc.namespace`), for every tree op on it."""
        check_namespace(namespace)
        if rid in self._reqs:
            raise DuplicateRequestError(f"request {rid!r} is already open")
        row = self.table.alloc()
        if row is None:
            raise OutOfRowsError(
                f"all {self.table.num_rows - 1} req_to_token rows are in use "
                "(raise max_running_requests)"
            )
        self._reqs[rid] = ReqKV(rid, row, self.tree.root, self._kv_lens, namespace=namespace)
        if self.scrub is not None:
            self.scrub.open_row(row, namespace)
        self._kv_lens[row] = 0
        if self.swa is not None:
            self.swa.open(row, 0)
        self._rids_by_row[row] = rid
        self.rows_generation += 1
        return row

    def request(self, rid: str) -> ReqKV:
        try:
            return self._reqs[rid]
        except KeyError:
            raise UnknownRequestError(f"no open request {rid!r}") from None

    def open_rids(self) -> list[str]:
        return list(self._reqs)

    def is_open(self, rid: str) -> bool:
        return rid in self._reqs

    def rid_of_row(self, row: int) -> str:
        try:
            return self._rids_by_row[row]
        except KeyError:
            raise UnknownRequestError(f"no open request in row {row}") from None

    def slots(self, rid: str, start: int = 0, end: int | None = None) -> np.ndarray:
        req = self.request(rid)
        end = req.kv_len if end is None else end
        if not 0 <= start <= end <= req.kv_len:
            raise InvalidArgumentError(f"range {start}..{end} outside 0..{req.kv_len} of {rid!r}")
        return self.table.read(req.row, start, end)

    def match_prefix(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> int:
        """Reuse the longest cached prefix of ``token_ids`` for ``rid`` and lock it.

        Only for a request that holds no KV yet. Returns the matched length
        (page-aligned); those positions are written into the request's row.
        The caller passes at most ``len(fill_ids) - 1`` tokens, so at least
        one token is always computed.
        """
        return self.match_prefix_tiers(rid, token_ids).prefix_len

    def match_prefix_tiers(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> TierMatch:
        """:meth:`match_prefix` over all the cache's tiers: host / storage hits (hicache)
        are loaded into fresh device pages; the rid's next :meth:`alloc_extend` waits
        for that copy."""
        req = self.request(rid)
        if req.kv_len:
            raise InvalidArgumentError(f"request {rid!r} already holds {req.kv_len} KV positions")
        tokens = as_token_array(token_ids)
        if tokens.size > self.table.max_context_len:
            raise InvalidArgumentError(
                f"{tokens.size} tokens exceed max_context_len {self.table.max_context_len}"
            )
        match = self._prefixes.match(req, tokens)
        if self.scrub is not None and req.namespace and match.prefix_len:
            self.scrub.taint_slots(self.table.read(req.row, 0, match.prefix_len), self.page_size)
        if self.swa is not None:
            self.swa.open(req.row, req.protected_len)
        return match

    def settle_loads(self, rids: Iterable[str]) -> dict[str, int]:
        """Wait for the loads of ``rids``' matched prefixes (hicache).

        Returns those of ``rids`` whose prefix was cut back since their match,
        with the prefix length each holds now: a load met a page that failed
        verification, a miss for the requests holding it alone. Their rows keep
        the good prefix (locked) and nothing else; they recompute from there.
        """
        return self._prefixes.settle(rids)

    def wait_loaded(self, rid: str) -> int | None:
        """:meth:`settle_loads` for one request: its prefix length if it was cut, else None."""
        return self.settle_loads([rid]).get(rid)

    def extend_tokens_required(self, items: Iterable[tuple[str, int]]) -> int:
        """Free slots an :meth:`alloc_extend` of ``items`` would consume."""
        return self.page_size * self._pages_for_extend(list(items))[0]

    def _pages_for_extend(self, items: list[tuple[str, int]]) -> tuple[int, list[int]]:
        per_request = []
        seen = set()
        for rid, num_tokens in items:
            req = self.request(rid)
            if rid in seen:
                raise InvalidArgumentError(f"request {rid!r} appears twice in one batch")
            seen.add(rid)
            if num_tokens < 0:
                raise InvalidArgumentError(f"cannot extend {rid!r} by {num_tokens} tokens")
            if req.kv_len + num_tokens > self.table.max_context_len:
                raise InvalidArgumentError(
                    f"{rid!r} would reach {req.kv_len + num_tokens} tokens, over max_context_len "
                    f"{self.table.max_context_len}"
                )
            per_request.append(num_new_pages(self.page_size, req.kv_len, req.kv_len + num_tokens))
        return sum(per_request), per_request

    def alloc_extend(
        self, items: Sequence[tuple[str, int]], *, evict: bool = True
    ) -> np.ndarray | None:
        """Give each ``(rid, num_tokens)`` that many new positions, all or nothing.

        Returns the new slots, request after request (the forward pass's
        output locations), or ``None`` if the pool cannot hold them even
        after evicting the shortfall from the tree (with ``evict``). First it
        waits for the requests' prefix loads (hicache); if one failed and cut
        a request's prefix back, it raises :class:`PrefixCutError` naming them
        and allocates nothing (the caller recomputes from the shorter prefix,
        or releases those requests and tries the rest).
        """
        items = list(items)
        total_pages, per_request = self._pages_for_extend(items)
        if self._prefixes.busy:
            cut = self.settle_loads(rid for rid, _ in items)
            if cut:
                raise PrefixCutError.of(cut)
        if self.swa is not None:  # the pages this allocation frees, first: it may use them
            self.swa.release(np.array([self._reqs[rid].row for rid, n in items if n]))
        if evict:
            self.ensure_available(total_pages * self.page_size)
        if total_pages > self.allocator.num_free_pages:
            return None
        out = []
        starts = []
        for (rid, num_tokens), num_pages in zip(items, per_request, strict=True):
            req = self._reqs[rid]
            if num_tokens:  # (no positions: no batch the window must cover)
                starts.append((req.row, req.kv_len))
            pages = self.allocator.alloc_pages(num_pages, owner=req.row)
            last_slot = int(self.table.array[req.row, req.kv_len - 1]) if req.kv_len else 0
            slots = extend_slots(pages, self.page_size, req.kv_len, num_tokens, last_slot)
            self.table.write(req.row, req.kv_len, slots)
            req.kv_len += num_tokens
            out.append(slots)
        if self.swa is not None and starts:
            rows, lens = zip(*starts, strict=True)
            self.swa.allocated(np.array(rows), np.array(lens))
        return np.concatenate(out) if out else np.empty(0, dtype=SLOT_DTYPE)

    def decode_tokens_required(self, rids: Iterable[str]) -> int:
        """``page_size × #(requests whose next position opens a new page)``."""
        return self.page_size * sum(
            1 for rid in rids if self.request(rid).kv_len % self.page_size == 0
        )

    def check_decode_mem(self, rids: Iterable[str]) -> bool:
        """Evict the shortfall for the next decode step, then say whether it fits."""
        rids = list(rids)
        if self.swa is not None:  # what the step's allocation frees first (alloc_decode_rows)
            self.swa.release(np.array([self.request(rid).row for rid in rids], dtype=np.int64))
        needed = self.decode_tokens_required(rids)
        self.ensure_available(needed)
        return self.available_size() >= needed

    def alloc_decode(self, rids: Sequence[str], *, evict: bool = True) -> np.ndarray | None:
        """One new position per request (a decode step), all or nothing."""
        rows = np.array([self.request(rid).row for rid in rids], dtype=np.int64)
        return self.alloc_decode_rows(rows, evict=evict)

    def decode_tokens_required_rows(self, rows: np.ndarray) -> int:
        return self._rows.tokens_required(rows)

    def alloc_decode_rows(
        self, rows: np.ndarray, *, evict: bool = True, rows_checked: bool = False
    ) -> np.ndarray | None:
        """:meth:`alloc_decode` by ``req_to_token`` row, vectorized over the batch
        (see :mod:`memsvc.core.decode_rows`); ``rows_checked`` skips
        :meth:`check_rows` when the caller just ran it."""
        make_room = self.ensure_available if evict else None
        if self.swa is not None:  # the pages this allocation frees, first: it may use them
            if not rows_checked:
                rows, rows_checked = self.check_rows(rows), True
            self.swa.release(rows)
        slots = self._rows.allocate(rows, make_room=make_room, rows_checked=rows_checked)
        if self.swa is not None and slots is not None:
            rows = np.asarray(rows, dtype=np.int64)
            self.swa.allocated(rows, self._kv_lens[rows] - 1)
        return slots

    def check_rows(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` as int64, if each is an open request's row and none repeats."""
        return self._rows.check(rows)

    def check_decode_mem_rows(self, rows: np.ndarray) -> bool:
        if self.swa is not None:  # what the step's allocation frees first (alloc_decode_rows)
            self.swa.release(rows)
        needed = self.decode_tokens_required_rows(rows)
        self.ensure_available(needed)
        return self.available_size() >= needed

    def retract(
        self,
        rows: Sequence[int] | np.ndarray,
        *,
        offload: bool | np.ndarray,
        retract_decode_steps: int,
        to_tree: dict[int, np.ndarray] | None = None,
    ) -> RetractResult:
        """Release requests from the end of ``rows`` until the next decode step fits.

        See :func:`memsvc.core.retract.retract_until_fits`.
        """
        return retract_until_fits(
            self,
            rows,
            offload=offload,
            retract_decode_steps=retract_decode_steps,
            to_tree=to_tree,
        )

    def evict(self, num_tokens: int) -> int:
        """Free full-pool tokens from the tree (with their SWA pages)."""
        return self.tree.evict(num_tokens)

    def evict_swa(self, num_tokens: int) -> int:
        """Free SWA-pool tokens from the tree, tombstoning (hybrid models; else 0)."""
        tree = self.tree
        return tree.evict_swa(num_tokens) if isinstance(tree, SWARadixCache) else 0

    def flush_cache(self, *, device_only: bool = False, namespace: str | None = None) -> int:
        """Evict every unlocked prefix (and, with the hierarchy, drop the host and storage
        copies unless ``device_only``); returns the device tokens evicted. With
        ``namespace``: that cache namespace's prefixes alone (its SWA pages go with its
        evicted nodes; the locked ones keep theirs)."""
        if namespace is not None:
            return self.tree.flush(device_only=device_only, namespace=check_namespace(namespace))
        evicted = self.tree.flush(device_only=device_only)
        if isinstance(self.tree, SWARadixCache):
            self.tree.flush_swa()
        return evicted

    def namespace_stats(self, top: int = NAMESPACE_STATS_TOP) -> dict[str, dict[str, int]]:
        """The ``top`` namespaces by device tokens cached (then by tokens matched), by
        label (:func:`~memsvc.namespace.namespace_label`, never a salt): cached tokens and
        tokens matched per tier. No tree walk."""
        cached = self.tree.namespace_tokens()
        hits = self._prefixes.namespace_hits
        names = sorted(
            set(cached) | set(hits),
            key=lambda ns: (-cached.get(ns, 0), -hits.get(ns, {}).get("matched_tokens", 0), ns),
        )[:top]
        out = {}
        for ns in names:
            row = {"cached_tokens": cached.get(ns, 0)}
            row.update(hits.get(ns, dict.fromkeys(NAMESPACE_HIT_KEYS, 0)))
            out[namespace_label(ns)] = row
        return out

    def ensure_available(self, num_tokens: int) -> None:
        """Evict from the tree only what is missing for ``num_tokens`` free slots; for a
        hybrid model each pool's shortfall, full first (it frees SWA pages too)."""
        if self.swa is not None:
            full_shortfall = num_tokens - self.full_available_size()
            if full_shortfall > 0:
                self.tree.evict(full_shortfall)
            swa_shortfall = num_tokens - self.swa_available_size()
            if swa_shortfall > 0:
                self.evict_swa(swa_shortfall)
            return
        shortfall = num_tokens - self.available_size()
        if shortfall > 0:
            self.tree.evict(shortfall)

    def cache_unfinished(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> int:
        """Publish a running request's page-aligned KV to the tree; returns the new prefix len.

        ``token_ids`` are the request's tokens whose KV is written (``kv_len`` of them).
        """
        req = self.request(rid)
        kv_len = req.kv_len
        protected_len = self._prefixes.publish(req, token_ids)
        if self.swa is not None:
            if req.kv_len < kv_len:  # its decode slot reserved ahead, handed back
                self.swa.dropped(req.row)
            self.swa.published(req.row, protected_len)
        return protected_len

    def release(
        self,
        rid: str,
        token_ids: Sequence[int] | np.ndarray | None = None,
        *,
        is_insert: bool = True,
    ) -> None:
        """Close ``rid``: insert its KV into the tree (``is_insert``) or free it, free the row.

        Retract uses ``is_insert=False``: the tree prefix stays (unlocked,
        evictable), everything after it is freed, nothing is inserted.
        """
        req = self.request(rid)
        self._prefixes.hand_back(req, token_ids, is_insert=is_insert)
        if self.swa is not None:  # its pinned pages are still the tree's: only unpinned
            self.swa.close(req.row)
        # Zeroed, so a worker handed a stale row sees slot 0 (the padding page) and refuses.
        self.table.write(req.row, 0, np.zeros(req.kv_len, dtype=SLOT_DTYPE))
        self.table.free(req.row)
        del self._reqs[rid]
        del self._rids_by_row[req.row]
        self.rows_generation += 1

    def check_written_tokens(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Raise unless ``token_ids`` can be ``rid``'s written KV's token ids (as many as
        its ``kv_len``, or one fewer with its next decode slot reserved ahead)."""
        self._prefixes.committed_tokens(self.request(rid), token_ids)

    def check_tree_tokens(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Raise unless ``token_ids`` can be ``rid``'s :meth:`release_to_tree` tokens."""
        self.tree.check_can_back_up()
        self._prefixes.check_tree_tokens(self.request(rid), token_ids)

    def release_to_tree(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> int:
        """Close ``rid`` inserting its KV into the tree, and back its path up to the host
        tier now (hicache; a normal-mode retract victim); returns the bytes copied."""
        self.tree.check_can_back_up()
        namespace = self.request(rid).namespace
        before = self.tree.backup_bytes()  # write_through copies on the insert itself
        self.release(rid, token_ids, is_insert=True)
        self.tree.backup_prefix(token_ids, namespace)
        return self.tree.backup_bytes() - before

    # -- integrity -------------------------------------------------------------

    def settle_copies(self) -> None:
        """Wait for every offload copy in flight; pages waiting on them become free."""
        self.tree.settle()
        self.allocator.drain()

    def check_integrity(self, *, idle: bool = False) -> None:
        """Raise :class:`IntegrityError` unless every page is in exactly one place
        and every counter agrees; with ``idle``, also that nothing is held."""
        check_pool(self, idle=idle)

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        self.settle_copies()
        self.tree.close()
        self.buffers.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
