"""The ``req_to_token`` table: one row per running request, KV slot per position.

``table[row, pos]`` is the KV slot of token ``pos`` of the request in ``row``.
Shape ``[max_running_requests + 1, max_context_len]``, int32, in the backend's
memory so the model worker reads it zero-copy; row 0 is a dummy for padding.
"""

from __future__ import annotations

import numpy as np

from memsvc.core.backends.base import KVBuffers
from memsvc.core.errors import InvalidArgumentError


class ReqToTokenTable:
    def __init__(self, buffers: KVBuffers) -> None:
        self._buffers = buffers
        self.num_rows, self.max_context_len = buffers.layout.req_to_token_shape
        self._free_rows: list[int] = list(range(self.num_rows - 1, 0, -1))
        self._row_in_use = np.zeros(self.num_rows, dtype=bool)

    @property
    def array(self) -> np.ndarray:
        """The host view of the table (read-only use; write through :meth:`write`)."""
        return self._buffers.req_to_token

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or ``None`` when every row is taken."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._row_in_use[row] = True
        return row

    def free(self, row: int) -> None:
        self._check_row(row)
        self._row_in_use[row] = False
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        self._check_row(row)
        if start < 0 or start + slots.size > self.max_context_len:
            raise InvalidArgumentError(
                f"positions {start}..{start + slots.size} exceed max_context_len "
                f"{self.max_context_len}"
            )
        self._buffers.write_row(row, start, slots)

    def write_cells(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """``table[rows[i], positions[i]] = slots[i]`` (rows already checked by the caller)."""
        self._buffers.write_cells(rows, positions, slots)

    def read(self, row: int, start: int, end: int) -> np.ndarray:
        return self._buffers.req_to_token[row, start:end].astype(np.int64)

    def is_open(self, rows: np.ndarray) -> bool:
        """Whether every one of ``rows`` (in range) is allocated."""
        return bool(self._row_in_use[rows].all())

    def in_use_mask(self) -> np.ndarray:
        """A boolean per row (a read-only view)."""
        view = self._row_in_use.view()
        view.flags.writeable = False
        return view

    def rows_in_use(self) -> np.ndarray:
        return np.flatnonzero(self._row_in_use)

    def _check_row(self, row: int) -> None:
        if not 1 <= row < self.num_rows or not self._row_in_use[row]:
            raise InvalidArgumentError(f"req_to_token row {row} is not allocated")
