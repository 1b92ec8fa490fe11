"""Budgets on the SWA pool of a hybrid (sliding-window) model, as SGLang 0.5.23 keeps them.

A hybrid model has two pools: the full pool (full-attention layers, every
position) and the SWA pool (sliding-window layers, only the last ``W``
positions of each request, freed page by page as the window slides). The
scheduler's pure core gets the SWA pool's numbers from memsvc as it gets the
full pool's: :class:`SwaSpec` (fixed, from the pool layout) and
:class:`SwaSizes` (live, from every reply). ``None`` for either means "not
hybrid": every function here then leaves today's single-pool rule unchanged.

What a request of length ``L`` still holds in the SWA pool (page aligned)::

    positions  0 ............ floor_page(L - W) ........ L
               |  freed: left the window  |  SWA tail   |
    _swa_tail_len(L) = L - floor_page(max(0, L - W))

The rules, each SGLang's (reference §3.2, §7.2; differences D15, D26, D30,
D32, D41, D42, D43):

- :func:`check_decode_mem`: both shortfalls evicted, both pools compared (D15);
- :class:`SwaPrefillGate`: admission's separate SWA gate (D26), which may
  lower the chunk limit (D30) or park the in-progress chunk (D32);
- :func:`prealloc_required_tokens`, :func:`swa_allocatable_tokens`,
  :func:`need_swa_single`: PD decode pre-allocation and resume (D41-D43);

The intake refusal built on these is :mod:`scheduler_svc.core.swa_intake`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


def _ceil_page(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size) * page_size


def _floor_page(num_tokens: int, page_size: int) -> int:
    return num_tokens // page_size * page_size


@dataclass(frozen=True, slots=True)
class SwaSpec:
    """What does not change about the SWA pool (memsvc's ``PoolLayout``).

    ``capacity``: the SWA pool's usable token slots (``swa_capacity_tokens``,
    SGLang's ``size_swa``). ``all_swa``: every layer is windowed (pure SWA,
    e.g. Mistral); admission then bases its total budget on the SWA pool.
    ``radix_cache``: the prefix cache is on (SGLang's ``not disable_radix_cache``;
    always on in kvstack). ``decode_radix_cache``: a PD decode node matches
    prefixes in its own tree before pre-allocating (SGLang's
    ``disaggregation_decode_enable_radix_cache``; kvstack's decode node does not).
    """

    sliding_window: int
    capacity: int
    page_size: int
    all_swa: bool = False
    radix_cache: bool = True
    decode_radix_cache: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window < 1 or self.capacity < 1 or self.page_size < 1:
            raise ValueError(
                "SwaSpec needs sliding_window, capacity and page_size >= 1, got "
                f"{self.sliding_window}, {self.capacity}, {self.page_size}"
            )

    @property
    def uses_tail_prealloc(self) -> bool:
        """SGLang's ``_uses_swa_tail_prealloc``: a PD decode node allocates only the SWA
        tail of what it pre-allocates, and budgets the SWA pool, only with ``page_size > 1``."""
        return self.page_size > 1

    def tail_len(self, seq_len: int) -> int:
        """:func:`swa_tail_len` for this pool."""
        return swa_tail_len(
            seq_len,
            self.sliding_window,
            self.page_size,
            decode_radix_cache=self.decode_radix_cache,
        )


class SwaSizes(NamedTuple):
    """The SWA pool's live sizes, in tokens (memsvc's ``swa_available`` /
    ``swa_evictable``, carried by every reply beside the full pool's)."""

    available: int
    evictable: int


def swa_sizes_of(sizes: object) -> SwaSizes | None:
    """The SWA part of memsvc's ``PoolSizes``, or None when the reply has none
    (a memsvc without a hybrid pool)."""
    available = getattr(sizes, "swa_available", None)
    if available is None:
        return None
    return SwaSizes(int(available), int(getattr(sizes, "swa_evictable", 0) or 0))


def full_available_of(sizes: object) -> int:
    """The full pool's free tokens in memsvc's ``PoolSizes``: ``full_available`` when the
    reply has it (a hybrid pool, whose ``available`` may be ``min(full, swa)``), else
    ``available``."""
    full = getattr(sizes, "full_available", None)
    return int(sizes.available if full is None else full)  # type: ignore[attr-defined]


def swa_spec_of(layout: object, *, decode_radix_cache: bool = False) -> SwaSpec | None:
    """The :class:`SwaSpec` of memsvc's ``PoolLayout``, or None unless it is hybrid."""
    if layout is None or not getattr(layout, "is_hybrid", False):
        return None
    full_layers = getattr(layout, "full_layer_ids", None)
    return SwaSpec(
        sliding_window=int(layout.sliding_window),  # type: ignore[attr-defined]
        capacity=int(layout.swa_capacity_tokens),  # type: ignore[attr-defined]
        page_size=int(layout.page_size),  # type: ignore[attr-defined]
        all_swa=full_layers is not None and len(full_layers) == 0,
        decode_radix_cache=decode_radix_cache,
    )


# -- lengths -------------------------------------------------------------------


def swa_tail_len(
    seq_len: int, sliding_window: int, page_size: int, *, decode_radix_cache: bool = False
) -> int:
    """SWA slots a request of ``seq_len`` tokens holds: from the page of its window's start.

    ``L - floor_page(max(0, L - W))``. With the decode radix cache (D42) the
    window starts ``max(window, page_size)`` before the last token:
    ``L - floor_page(max(0, L - 1 - max(W, page_size)))``, so a tail cached in
    the tree still covers the window of the next token. ``seq_len <= 0``: 0.
    """
    if seq_len <= 0:
        return 0
    if sliding_window <= 0:
        return seq_len
    if decode_radix_cache:
        start = max(0, seq_len - 1 - max(sliding_window, page_size))
    else:
        start = max(0, seq_len - sliding_window)
    return seq_len - _floor_page(start, page_size)


def swa_retractable_len(origin_len: int, output_len: int, spec: SwaSpec | None) -> int:
    """SGLang's ``_swa_retractable_len``: the SWA slots retracting a running request frees,
    ``_swa_tail_len(len(origin)) + len(output)``; its whole length without tail prealloc."""
    if spec is None or not spec.uses_tail_prealloc:
        return origin_len + output_len
    return spec.tail_len(origin_len) + output_len


def estimate_swa_kv_tokens(
    extend_len: int,
    max_new_tokens: int,
    sliding_window: int,
    page_size: int,
    *,
    allocation_limit: int | None = None,
) -> int:
    """The most SWA slots admitting a prefill of ``extend_len`` (then ``max_new_tokens``
    of decode) takes at once: SGLang's SWA reservation.

    The extend is allocated whole in both pools (lockstep), up to
    ``allocation_limit`` (the chunk); what lies before its last ``W`` tokens is
    freed only after the forward, hence ``max(allocated − W, 0)``. Then the
    request holds at most its window: ``min(extend + max_new, W)``. Plus one
    page of paged-allocation rounding.
    """
    if sliding_window <= 0:
        return extend_len + max_new_tokens + page_size
    allocated = extend_len if allocation_limit is None else min(extend_len, allocation_limit)
    tail = max(allocated - sliding_window, 0)
    return tail + min(extend_len + max_new_tokens, sliding_window) + page_size


# -- decode: check_decode_mem (D15) ---------------------------------------------


class DecodeMemCheck(NamedTuple):
    """What :func:`check_decode_mem` decides: tokens to evict from each pool's tree
    (the shortfall only), and whether the step fits after that."""

    full_evict: int
    swa_evict: int
    fits: bool


def check_decode_mem(
    num_tokens: int,
    full_available: int,
    full_evictable: int,
    swa: SwaSizes | None = None,
) -> DecodeMemCheck:
    """SGLang's ``check_decode_mem`` on numbers: evict each pool's shortfall, compare both.

    ``num_tokens`` is :func:`~scheduler_svc.core.policy.decode_tokens_required`.
    One pool: evict ``max(0, n − available)``; fits iff ``available >= n``
    after. Hybrid (``swa``): the same for each pool, and the step fits only if
    both do (the SWA allocator's ``available_size`` is ``min(full, swa)``). An
    eviction frees at most what is evictable; memsvc does the evicting.
    """
    full_evict = max(0, num_tokens - full_available)
    full_after = full_available + min(full_evict, full_evictable)
    if swa is None:
        return DecodeMemCheck(full_evict, 0, full_after >= num_tokens)
    swa_evict = max(0, num_tokens - swa.available)
    swa_after = swa.available + min(swa_evict, swa.evictable)
    return DecodeMemCheck(full_evict, swa_evict, min(full_after, swa_after) >= num_tokens)


# -- admission: the SWA gate of PrefillAdder (D26, D30, D32) -----------------------


class SwaPrefillGate:
    """The SWA half of SGLang's ``SWAPrefillBudget``, for one admission round.

    ``remaining_swa = swa_available + swa_evictable − swa_offset``, where the
    offset sums this round's SWA reservations (:func:`estimate_swa_kv_tokens`
    of each admission). Running requests reserve nothing here: their SWA need
    stops growing at the window. The total and current budgets stay the full
    pool's (the SWA pool's for a pure-SWA model: ``all_swa``).
    """

    def __init__(self, spec: SwaSpec, sizes: SwaSizes) -> None:
        self.spec = spec
        self.sizes = sizes
        self.swa_offset = 0

    @property
    def remaining_swa(self) -> int:
        return self.sizes.available + self.sizes.evictable - self.swa_offset

    @property
    def base_tokens(self) -> int:
        """available + evictable of the SWA pool: the total/current base of a pure-SWA model."""
        return self.sizes.available + self.sizes.evictable

    def has_capacity(self) -> bool:
        return self.remaining_swa > 0

    def pin(self, num_tokens: int) -> None:
        """A prefix lock took ``num_tokens`` of the SWA pool's evictable tokens."""
        sizes = self.sizes
        self.sizes = SwaSizes(
            sizes.available, sizes.evictable - min(max(num_tokens, 0), sizes.evictable)
        )

    def tokens(self, extend_len: int, max_new_tokens: int, chunk_limit: int | None = None) -> int:
        spec = self.spec
        return estimate_swa_kv_tokens(
            extend_len,
            max_new_tokens,
            spec.sliding_window,
            spec.page_size,
            allocation_limit=chunk_limit,
        )

    def never_fits(self, extend_len: int, max_new_tokens: int, chunk_limit: int | None) -> bool:
        """Even an empty SWA pool could not take it (the SWA check is strict)."""
        return self.tokens(extend_len, max_new_tokens, chunk_limit) >= self.spec.capacity

    def check(
        self, extend_len: int, max_new_tokens: int, chunk_limit: int | None
    ) -> tuple[bool, int | None]:
        """SGLang's SWA ``check_prefill`` (after the full pool's check passed).

        Returns (admissible, chunk limit). It fits if its reservation (of the
        page-rounded extend, allocated up to ``chunk_limit``) is strictly below
        ``remaining_swa``. If not: only a request that could never fit may be
        chunked smaller, to what the SWA budget leaves beside its window of
        output (D30); a shortfall that is only transient waits, so a new
        prefill does not eat running requests' window headroom.
        """
        paged = _ceil_page(extend_len, self.spec.page_size)
        if self.tokens(paged, max_new_tokens, chunk_limit) < self.remaining_swa:
            return True, chunk_limit
        cap = 0
        if self.never_fits(paged, max_new_tokens, chunk_limit):
            headroom = self.tokens(0, max_new_tokens)
            cap = _floor_page(max(0, self.remaining_swa - headroom), self.spec.page_size)
        if chunk_limit is None or cap <= 0:
            return False, None
        return True, min(chunk_limit, cap)

    def available_chunk_tokens(self, chunk_limit: int, remaining_total: float) -> int | None:
        """The in-progress chunk's limit (D32): ``min(chunk, total, remaining_swa − page)``;
        None (park the chunk this round) when that is not positive."""
        available = min(chunk_limit, int(remaining_total), self.remaining_swa - self.spec.page_size)
        return available if available > 0 else None

    def reserve(self, extend_len: int, max_new_tokens: int) -> None:
        paged = _ceil_page(extend_len, self.spec.page_size)
        self.swa_offset += self.tokens(paged, max_new_tokens)


# -- PD decode: pre-allocation and resume (D41, D42, D43) --------------------------


def prealloc_required_tokens(
    fill_len: int, page_size: int, reserved: int, spec: SwaSpec | None = None
) -> tuple[int, int]:
    """SGLang's ``_prealloc_required_tokens``: (full, SWA) slots to pre-allocate ``fill_len``
    tokens of KV, with the per-request decode reserve ``R``.

    The full length and the SWA length (the tail of ``fill_len`` with tail
    prealloc, else ``fill_len``) are page-ceiled first when ``page_size > 1``
    (D41), then ``R`` is added; not to the SWA one when the radix cache is off.
    Not hybrid: the SWA requirement equals the full one.
    """
    full_len = fill_len
    swa_len = spec.tail_len(fill_len) if spec is not None and spec.uses_tail_prealloc else fill_len
    if page_size > 1:
        full_len = _ceil_page(full_len, page_size)
        swa_len = _ceil_page(swa_len, page_size)
    swa_reserved = reserved if spec is None or spec.radix_cache else 0
    return full_len + reserved, swa_len + swa_reserved


def need_swa_single(
    running: Iterable[tuple[int, int]],
    retractable_swa_tokens: int | None,
    spec: SwaSpec,
    clip: int,
) -> int:
    """SGLang's ``need_swa_space_for_single_req``: over the running requests
    ``(origin_len, max_new_tokens)``, the largest ``_swa_tail_len(origin) + min(max_new,
    clip) − retractable_swa_tokens``; 0 with none running or no retractable count."""
    if retractable_swa_tokens is None:
        return 0
    needs = [spec.tail_len(origin) + min(max_new, clip) for origin, max_new in running]
    return max(needs) - retractable_swa_tokens if needs else 0


def swa_allocatable_tokens(
    spec: SwaSpec,
    sizes: SwaSizes,
    *,
    n_active: int,
    reserved_per_req: int,
    need_single: int = 0,
    retracted_swa_required: int = 0,
) -> int:
    """SGLang's SWA-tail budget (``_swa_tail_allocatable_token_budget``, 0.5.23 form).

    ::

        reserved        = R × n_active
        swa_used        = capacity − swa_available
        swa_growth      = max(0, n_active × W − swa_used)   # SWA stops growing at the window
        swa_reserved    = min(reserved, swa_growth)
        swa_allocatable = swa_available + swa_evictable − max(swa_reserved, need_single)
                          − Σ retracted swa_required        (count_retracted only)

    ``swa_evictable`` is added as 0.5.23 does (D42). ``retracted_swa_required``
    is the SWA half of :func:`prealloc_required_tokens` summed over the
    retracted queue, or 0 when the retracted queue is not counted (resume).
    """
    reserved = reserved_per_req * n_active
    swa_used = spec.capacity - sizes.available
    growth = max(0, n_active * spec.sliding_window - swa_used)
    swa_reserved = min(reserved, growth)
    return (
        sizes.available + sizes.evictable - max(swa_reserved, need_single) - retracted_swa_required
    )
