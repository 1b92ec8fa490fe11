"""memsvc's ops as call descriptions, and the typed results they return.

Each method of :class:`_Ops` describes one request (op name, header fields,
array frames, how to read the reply) and hands it to ``_invoke``, which the
sync and the asyncio client implement each in their own way; so both clients
offer exactly the same ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from memsvc import protocol as p


class PoolSizes(NamedTuple):
    """The pool's sizes as of the last reply (every reply carries them; built on each)."""

    available: int  # what an allocation can have: a hybrid pool's min(full, swa)
    evictable: int
    protected: int
    host_free: int = 0  # bytes the host store can still take
    # a hybrid (sliding-window) pool's, pool by pool; None without one
    full_available: int | None = None
    swa_available: int | None = None
    swa_evictable: int | None = None
    swa_protected: int | None = None


@dataclass(frozen=True)
class AllocResult:
    """``alloc_extend`` / ``decode_step`` / ``load``: the new slots, or what is missing.

    ``cut`` (``alloc_extend`` with the hierarchical cache): requests whose matched
    prefix was cut back because a page loaded for it failed verification, with the
    prefix length each holds now; nothing was allocated.
    """

    fits: bool
    slots: np.ndarray | None = None
    missing: int = 0
    cut: dict[str, int] = field(default_factory=dict)


class PrefixMatch(NamedTuple):
    """``match_prefix``'s reply: ``prefix_len = device_hit + host_hit + storage_hit``."""

    prefix_len: int
    device_hit: int
    host_hit: int = 0
    storage_hit: int = 0
    load_pending: bool = False


class AdmitMatch(NamedTuple):
    """One ``admit`` candidate: its row, its locked prefix split by tier, and ``pinned``,
    what its match took from available + evictable (read around its match alone)."""

    row: int
    prefix_len: int
    device_hit: int
    host_hit: int
    storage_hit: int
    load_pending: bool
    pinned: int
    swa_pinned: int = 0  # a hybrid pool: what the match took from the SWA evictable size


@dataclass(frozen=True)
class AdmitResult:
    """``admit``'s reply: a match for each candidate opened, in order; ``out_of_rows``
    when the one after the last had no row, ``not_owner`` when it belongs to another
    session (it and the rest were not touched)."""

    matches: list[AdmitMatch]
    out_of_rows: bool
    before: PoolSizes  # the pool's sizes before the first candidate was opened
    not_owner: str | None = None  # the one after the last belongs to another session


@dataclass(frozen=True)
class RetractReply:
    retracted: list[str]
    offload_failed: list[str]
    tokens_gained: int
    last_does_not_fit: bool
    to_tree: list[str] = field(default_factory=list)  # of retracted: KV kept in the tree


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
    return AllocResult(False, None, int(header["missing"]), dict(header.get("cut") or {}))


def _nothing(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    return None


_ADMIT_COLUMNS = 7  # the wire's matches table: AdmitMatch's fields up to pinned


def _admit_result(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> AdmitResult:
    table = arrays["matches"].reshape(-1, _ADMIT_COLUMNS).tolist()
    matches = [
        AdmitMatch(r, n, d, h, s, bool(pending), pin) for r, n, d, h, s, pending, pin in table
    ]
    before = PoolSizes(*header["before"])
    if "swa_pinned" in arrays:  # a hybrid pool
        swa_pinned = arrays["swa_pinned"].tolist()
        matches = [m._replace(swa_pinned=n) for m, n in zip(matches, swa_pinned, strict=True)]
        before = PoolSizes(*header["before"], *header["before_swa"])
    return AdmitResult(matches, bool(header["out_of_rows"]), before, header.get("not_owner"))


def _batch(items: Sequence[tuple[Any, ...]]) -> tuple[list[str], dict[str, np.ndarray]]:
    """The rids of ``(rid, token_ids, ...)`` items, and their token ids concatenated with
    one length per rid (``None`` for none)."""
    parts = [_as_array([] if item[1] is None else item[1]) for item in items]
    arrays = {
        "token_ids": _as_array(np.concatenate(parts) if parts else []),
        "token_lens": _as_array([part.size for part in parts]),
    }
    return [item[0] for item in items], arrays


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

    def flush_cache(self, *, device_only: bool = False, namespace: str | None = None) -> Any:
        """Evict everything evictable from the prefix tree (and the lower tiers unless
        ``device_only``); with ``namespace`` (a cache namespace, :mod:`memsvc.namespace`),
        that namespace's alone, in every tier. Returns the device tokens freed."""
        header: dict[str, Any] = {"device_only": device_only}
        if namespace is not None:
            header["namespace"] = namespace
        return self._invoke(_Call("flush_cache", header, None, lambda h, a: int(h["evicted"])))

    def alloc_row(self, rid: str, namespace: str = "") -> Any:
        """Open request ``rid`` and give it a ``req_to_token`` row; returns the row.
        ``namespace``: the cache namespace its KV is shared in (every later tree op on
        ``rid`` uses it)."""
        fields: dict[str, Any] = {"rid": rid}
        if namespace:
            fields["namespace"] = namespace
        return self._invoke(_Call("alloc_row", fields, None, lambda h, a: h["row"]))

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

    def match_prefix_tiers(self, rid: str, token_ids: Sequence[int] | np.ndarray) -> Any:
        """:meth:`match_prefix` with where the prefix came from -> PrefixMatch.

        With the hierarchical cache, host / storage hits are loaded into fresh
        device pages; the rid's next ``alloc_extend`` waits for that copy.
        """
        return self._invoke(
            _Call(
                "match_prefix",
                {"rid": rid},
                {"token_ids": _as_array(token_ids)},
                lambda h, a: PrefixMatch(
                    h["prefix_len"],
                    h.get("device_hit", h["prefix_len"]),
                    h.get("host_hit", 0),
                    h.get("storage_hit", 0),
                    h.get("load_pending", False),
                ),
            )
        )

    def admit(
        self,
        items: Sequence[tuple[str, Sequence[int] | np.ndarray]],
        *,
        recompute_s_per_token: float | None = None,
        namespaces: Sequence[str] | None = None,
    ) -> Any:
        """For each ``(rid, token_ids)`` in order: :meth:`alloc_row` then
        :meth:`match_prefix_tiers`, in one round trip -> AdmitResult. ``namespaces``:
        each rid's cache namespace, in order (None: all the default one).

        Stops at the first rid that gets no row. Any other failure closes
        every rid it opened and raises. ``recompute_s_per_token``: the worker's
        prefill time per token, for the hierarchical cache's load-or-recompute model.
        """
        rids, arrays = _batch(items)
        fields: dict[str, Any] = {"rids": rids}
        if recompute_s_per_token is not None:
            fields["recompute_s_per_token"] = recompute_s_per_token
        if namespaces is not None and any(namespaces):
            fields["namespaces"] = list(namespaces)
        return self._invoke(_Call("admit", fields, arrays, _admit_result))

    def alloc_extend(self, items: Sequence[tuple[str, int]], free: Sequence[str] = ()) -> Any:
        """New positions for each ``(rid, num_tokens)``, all or nothing -> AllocResult.

        ``free``: rids closed first as by :meth:`free_row` (an admission round's
        candidates not admitted), whether the extend then fits or not.
        """
        fields: dict[str, Any] = {"rids": [rid for rid, _ in items]}
        if free:
            fields["free_rids"] = list(free)
        counts = _as_array([n for _, n in items])
        return self._invoke(_Call("alloc_extend", fields, {"num_tokens": counts}, _alloc_result))

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

    def cache_unfinished_many(self, items: Sequence[tuple[str, Sequence[int] | np.ndarray]]) -> Any:
        """:meth:`cache_unfinished` for each ``(rid, token_ids)``, in one round trip;
        returns the new prefix lengths."""
        rids, arrays = _batch(items)
        return self._invoke(
            _Call(
                "cache_unfinished_many",
                {"rids": rids},
                arrays,
                lambda h, a: a["prefix_lens"].tolist(),
            )
        )

    def release_many(
        self, items: Sequence[tuple[str, Sequence[int] | np.ndarray | None, bool]]
    ) -> Any:
        """:meth:`release` for each ``(rid, token_ids, is_insert)``, in one round trip."""
        rids, arrays = _batch(items)
        fields = {"rids": rids, "is_insert": [bool(item[2]) for item in items]}
        return self._invoke(_Call("release_many", fields, arrays, _nothing))

    def decode_step(self, rows: Sequence[int] | np.ndarray) -> Any:
        """Check decode memory and allocate one slot per row, in one round trip -> AllocResult."""
        return self._invoke(_Call("decode_step", {}, {"rows": _as_array(rows)}, _alloc_result))

    def retract(
        self,
        rows: Sequence[int] | np.ndarray,
        targets: Sequence[p.RetractTarget],
        token_ids: Sequence[Sequence[int] | np.ndarray | None] | None = None,
    ) -> Any:
        """Release from the end of ``rows`` (victim order) until the next step fits.

        ``targets`` says, per row, where that victim's KV goes (a
        :class:`~memsvc.protocol.RetractTarget`). Rows going into the tree
        need their committed token ids in ``token_ids`` (one entry per row;
        ``None`` for the others).
        """
        arrays = {"rows": _as_array(rows)}
        if token_ids is not None:
            tree = [
                t == p.RetractTarget.TREE and ids is not None
                for t, ids in zip(targets, token_ids, strict=True)
            ]
            parts = [_as_array(ids) for ids, t in zip(token_ids, tree, strict=True) if t]
            lens = [len(ids) if t else 0 for ids, t in zip(token_ids, tree, strict=True)]
            arrays["tree_lens"] = _as_array(lens)
            arrays["tree_tokens"] = _as_array(np.concatenate(parts) if parts else [])
        return self._invoke(
            _Call(
                "retract",
                {"targets": list(targets)},
                arrays,
                lambda h, a: RetractReply(
                    h["retracted"],
                    h["offload_failed"],
                    h["tokens_gained"],
                    h["last_does_not_fit"],
                    h.get("to_tree", []),
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
        peer: str | None = None,
        from_host: bool = False,
    ) -> Any:
        """Send ``rid``'s first ``num_tokens`` of KV to ``room``'s decode side (``peer``: its
        memsvc's transfer socket, if not this memsvc's --transfer-peer). ``from_host``:
        ``rid``'s host-store entry, all of it (a retracted request migrating)."""
        fields = {
            "rid": rid,
            "room": room,
            "num_tokens": num_tokens,
            "first_token": first_token,
            "cached_tokens": cached_tokens,
            "peer_rid": peer_rid,
        }
        if peer is not None:
            fields["peer"] = peer
        if from_host:
            fields["from_host"] = True
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
