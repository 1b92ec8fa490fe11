"""memsvc's ops as call descriptions, and the typed results they return.

Each method of :class:`_Ops` describes one request (op name, header fields,
array frames, how to read the reply) and hands it to ``_invoke``, which the
sync and the asyncio client implement each in their own way; so both clients
offer exactly the same ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from memsvc import protocol as p


class PoolSizes(NamedTuple):
    """The pool's sizes as of the last reply (every reply carries them; built on each)."""

    available: int
    evictable: int
    protected: int
    host_free: int = 0  # bytes the host store can still take


@dataclass(frozen=True)
class AllocResult:
    """``alloc_extend`` / ``decode_step`` / ``load``: the new slots, or what is missing."""

    fits: bool
    slots: np.ndarray | None = None
    missing: int = 0


@dataclass(frozen=True)
class RetractReply:
    retracted: list[str]
    offload_failed: list[str]
    tokens_gained: int
    last_does_not_fit: bool


class _Call(NamedTuple):
    """One request to make (a NamedTuple: built on every call, it must be cheap)."""

    op: str
    fields: dict[str, Any]
    arrays: dict[str, np.ndarray] | None
    parse: Callable[[dict[str, Any], dict[str, np.ndarray]], Any]


def _as_array(values: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(values, dtype=p.ARRAY_DTYPE)
    return array if array.ndim == 1 else array.reshape(-1)


def _alloc_result(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> AllocResult:
    if header["fits"]:
        return AllocResult(True, arrays["slots"])
    return AllocResult(False, None, int(header["missing"]))


def _nothing(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    return None


class _Ops:
    """Every memsvc op, as a call description; subclasses decide how to run it."""

    def _invoke(self, call: _Call) -> Any:
        raise NotImplementedError

    def heartbeat(self) -> Any:
        return self._invoke(_Call("heartbeat", {}, None, _nothing))

    def stats(self) -> Any:
        return self._invoke(_Call("stats", {}, None, lambda h, a: h))

    def check(self, *, idle: bool = False) -> Any:
        """The pool's integrity check; raises ``IntegrityError`` with what is wrong."""
        return self._invoke(_Call("check", {"idle": idle}, None, _nothing))

    def alloc_row(self, rid: str) -> Any:
        """Open request ``rid`` and give it a ``req_to_token`` row; returns the row."""
        return self._invoke(_Call("alloc_row", {"rid": rid}, None, lambda h, a: h["row"]))

    def free_row(self, rid: str) -> Any:
        """Close ``rid`` without caching anything."""
        return self._invoke(_Call("free_row", {"rid": rid}, None, _nothing))

    def match_prefix(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> Any:
        """Reuse and lock the longest cached prefix; returns its length."""
        return self._invoke(
            _Call(
                "match_prefix",
                {"rid": rid},
                {"token_ids": _as_array(token_ids)},
                lambda h, a: h["prefix_len"],
            )
        )

    def alloc_extend(self, items: Sequence[tuple[str, int]]) -> Any:
        """New positions for each ``(rid, num_tokens)``, all or nothing -> AllocResult."""
        rids = [rid for rid, _ in items]
        counts = _as_array([n for _, n in items])
        return self._invoke(
            _Call("alloc_extend", {"rids": rids}, {"num_tokens": counts}, _alloc_result)
        )

    def cache_unfinished(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> Any:
        return self._invoke(
            _Call(
                "cache_unfinished",
                {"rid": rid},
                {"token_ids": _as_array(token_ids)},
                lambda h, a: h["prefix_len"],
            )
        )

    def release(
        self,
        rid: str,
        token_ids: Sequence[int] | np.ndarray | None = None,
        *,
        is_insert: bool = True,
    ) -> Any:
        arrays = None if token_ids is None else {"token_ids": _as_array(token_ids)}
        return self._invoke(
            _Call("release", {"rid": rid, "is_insert": is_insert}, arrays, _nothing)
        )

    def decode_step(self, rows: Sequence[int] | np.ndarray) -> Any:
        """Check decode memory and allocate one slot per row, in one round trip -> AllocResult."""
        return self._invoke(_Call("decode_step", {}, {"rows": _as_array(rows)}, _alloc_result))

    def retract(
        self,
        rows: Sequence[int] | np.ndarray,
        mode: str = "recompute",
        offload: Sequence[bool] | None = None,
    ) -> Any:
        """Release from the end of ``rows`` (victim order) until the next step fits.

        ``mode`` is ``recompute``, ``offload``, or ``mixed`` with ``offload``
        giving per row whether its KV goes to the host store first.
        """
        arrays = {"rows": _as_array(rows)}
        if offload is not None:
            mode = "mixed"
            arrays["offload"] = _as_array([int(bool(x)) for x in offload])
        return self._invoke(
            _Call(
                "retract",
                {"mode": mode},
                arrays,
                lambda h, a: RetractReply(
                    h["retracted"], h["offload_failed"], h["tokens_gained"], h["last_does_not_fit"]
                ),
            )
        )

    def offload(self, rid: str, num_tokens: int | None = None) -> Any:
        """Copy ``rid``'s KV to the host store; returns bytes copied."""
        return self._invoke(
            _Call("offload", {"rid": rid, "num_tokens": num_tokens}, None, lambda h, a: h["bytes"])
        )

    def load(self, rid: str) -> Any:
        """Load ``rid``'s offloaded KV into fresh slots of its (empty) row -> AllocResult."""
        return self._invoke(_Call("load", {"rid": rid}, None, _alloc_result))

    # -- PD transfer (memsvc with --pd-role) --------------------------------------

    def pd_expect(self, rid: str, room: int) -> Any:
        """Decode side: ``rid``'s allocated slots wait for ``room``'s prompt KV."""
        return self._invoke(_Call("pd_expect", {"rid": rid, "room": room}, None, _nothing))

    def pd_send(
        self,
        rid: str,
        room: int,
        num_tokens: int,
        first_token: int,
        cached_tokens: int = 0,
        peer_rid: str | None = None,
    ) -> Any:
        """Prefill side: send ``rid``'s first ``num_tokens`` of KV to ``room``'s decode side."""
        fields = {
            "rid": rid,
            "room": room,
            "num_tokens": num_tokens,
            "first_token": first_token,
            "cached_tokens": cached_tokens,
            "peer_rid": peer_rid,
        }
        return self._invoke(_Call("pd_send", fields, None, _nothing))

    def pd_status(self, rooms: Sequence[int]) -> Any:
        """Each room's state: dicts with ``state`` (KVPoll), ``why``, ``first_token``..."""
        return self._invoke(
            _Call("pd_status", {}, {"rooms": _as_array(rooms)}, lambda h, a: h["rooms"])
        )

    def pd_forget(self, rooms: Sequence[int]) -> Any:
        return self._invoke(_Call("pd_forget", {}, {"rooms": _as_array(rooms)}, _nothing))

    def host_discard(self, rid: str) -> Any:
        return self._invoke(_Call("host_discard", {"rid": rid}, None, _nothing))
