"""Replies kept to answer a retry, bounded in count and in bytes (pure, synchronous).

memsvc keeps each session's replies to mutating ops (a retried op is answered,
not redone); the scheduler keeps finished results (a re-submitted rid is
answered, not run again). Either is only worth its memory for the recent past:
a bound in count alone let large replies (prompt logprobs, long page lists)
hold hundreds of MB. Both are a :class:`ReplyCache`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ReplyCache(Generic[K, V]):
    """The most recent values by key, each with its size in bytes.

    Eviction order: least recently put first, once there are more than
    ``max_entries`` or they hold more than ``max_bytes`` together. The newest
    value is always kept, whatever its size: a retry of the last op must still
    be answered. ``get`` does not change the order.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 0:
            raise ValueError(f"need max_entries >= 1, max_bytes >= 0 ({max_entries}, {max_bytes})")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """The bytes the kept values hold, as their sizes were given."""
        return self._num_bytes

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, num_bytes: int) -> None:
        """Keep ``value`` as the newest; forget the oldest past either bound."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._num_bytes -= old[1]
        self._entries[key] = (value, num_bytes)
        self._num_bytes += num_bytes
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes
        ):
            _, (_, size) = self._entries.popitem(last=False)
            self._num_bytes -= size
