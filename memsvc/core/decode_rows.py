"""A decode step over a batch of ``req_to_token`` rows: memsvc's hot path, vectorized.

Every open request has a row; :class:`DecodeRows` keeps each row's ``kv_len``
in one array, so that checking a batch of rows and giving each one its next
position is a fixed handful of numpy calls whatever the batch size, with no
per-request Python::

    kv_len % page_size == 0  ->  a fresh page, slot page * page_size
    otherwise                ->  the slot after the previous position's
    kv_len == max_context_len -> refused (the request is full)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memsvc.core.allocator import SLOT_DTYPE, PageAllocator
from memsvc.core.errors import InvalidArgumentError, UnknownRequestError
from memsvc.core.req_to_token import ReqToTokenTable

# What a decode step does to one request, by its kv_len (see DecodeRows._step_flags).
FILLS_PAGE, OPENS_PAGE, PAST_MAX_LEN = 0, 1, 2


class DecodeRows:
    def __init__(self, table: ReqToTokenTable, allocator: PageAllocator) -> None:
        self.table = table
        self.allocator = allocator
        self.page_size = allocator.page_size
        # kv_len of each row; ReqKV objects share it by reference
        self.kv_lens = np.zeros(table.num_rows, dtype=np.int64)
        self._scratch = np.zeros(table.num_rows, dtype=np.int64)
        self._positions = np.arange(table.num_rows, dtype=np.int64)
        self._step_flags = self._build_step_flags()

    def _build_step_flags(self) -> np.ndarray:
        """What a decode step does to a request of each ``kv_len`` (0..max_context_len).

        One gather from this table classifies a whole batch: it replaces a
        modulo, a count and a max, each a trip through numpy's ufunc machinery,
        which costs several microseconds with the caches cold (as they are
        when a request wakes the service).
        """
        max_len = self.table.max_context_len
        lengths = np.arange(max_len + 1)
        flags = np.where(lengths % self.page_size == 0, OPENS_PAGE, FILLS_PAGE).astype(np.uint8)
        flags[max_len] = PAST_MAX_LEN
        return flags

    def check(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` as int64, if each is an open request's row and none repeats."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1:
            raise InvalidArgumentError("rows must be one-dimensional")
        if not rows.size:
            return rows
        # One compare catches both ends: negative rows wrap to huge unsigned values.
        if (rows.view(np.uint64) >= self.table.num_rows).any() or not self.table.is_open(rows):
            raise UnknownRequestError("a row in the batch holds no open request")
        # Row 0 is never open, so a batch longer than the rest of the table repeats one
        # (and would not fit the scratch arrays below).
        if rows.size >= self.table.num_rows:
            raise InvalidArgumentError("a request appears twice in one batch")
        # Duplicates: scatter then gather positions; a repeated row keeps only one of them.
        positions = self._positions[: rows.size]
        self._scratch[rows] = positions
        if (self._scratch[rows] != positions).any():
            raise InvalidArgumentError("a request appears twice in one batch")
        return rows

    def tokens_required(self, rows: np.ndarray) -> int:
        """``page_size × #(rows whose next position opens a new page)``."""
        return self.page_size * int(np.count_nonzero(self.kv_lens[rows] % self.page_size == 0))

    def allocate(
        self,
        rows: np.ndarray,
        *,
        make_room: Callable[[int], None] | None,
        rows_checked: bool = False,
    ) -> np.ndarray | None:
        """One new position per row, all or nothing; ``None`` (nothing changed) if it
        does not fit. ``make_room(tokens)`` (eviction) runs first when free pages are
        short; ``rows_checked`` skips :meth:`check` when the caller just ran it."""
        if not rows_checked:
            rows = self.check(rows)
        kv_lens = self.kv_lens[rows]
        # One byte per request, read with bytes methods.
        flags = self._step_flags.take(kv_lens, mode="clip")
        flag_bytes = flags.tobytes()
        if PAST_MAX_LEN in flag_bytes:
            raise InvalidArgumentError(
                f"a request would exceed max_context_len {self.table.max_context_len}"
            )
        num_pages = flag_bytes.count(OPENS_PAGE)
        page_size = self.page_size
        if make_room is not None and num_pages * page_size > self.allocator.available_size():
            make_room(num_pages * page_size)
        if num_pages == rows.size:  # page_size 1, or every request at a page boundary
            pages = self.allocator.alloc_pages(num_pages, owner=rows)
            if pages is None:
                return None
            slots = pages * page_size
        else:
            # kv_len 0 always opens a page, so index -1 below is overwritten
            slots = np.add(self.table.array[rows, kv_lens - 1], 1, dtype=SLOT_DTYPE)
            if num_pages:
                opens_page = flags.view(np.bool_)  # flags are 0 / 1 here
                pages = self.allocator.alloc_pages(num_pages, owner=rows[opens_page])
                if pages is None:
                    return None
                slots[opens_page] = pages * page_size
        self.table.write_cells(rows, kv_lens, slots)
        self.kv_lens[rows] = kv_lens + 1
        return slots
