"""memsvc's batched request ops: one admission round, or one step's publishes and releases,
in one message.

A mixin of :class:`~memsvc.handlers.MemService` (it uses the service's pool,
sessions and ownership helpers). Every rid of a batch is checked like the
single-request op's before anything changes: it belongs to the session, it
is named once, and it is open (or, for ``admit``, not open yet).

``admit`` opens, matches and locks candidates in order and answers, per
candidate, one row of its ``matches`` array::

    row, prefix_len, device_hit, host_hit, storage_hit, load_pending, pinned

``pinned`` is what the candidate's match took from the evictable size (with
the hierarchical cache: and from the available size, the fresh device pages
its host / storage part loads into), read around that candidate's match
alone: the scheduler's admission budget loses it before the candidate is
judged. A candidate that belongs to another session ends the batch too,
untouched (``not_owner`` names it), as ``alloc_row`` would have refused it
there. The reply's ``before`` has the pool's sizes (available, evictable,
protected, host_free) before the first candidate was opened: the budget of
the round. A candidate that gets no row ends the batch (``out_of_rows``); any
other failure closes every candidate the message opened and is the reply.

A hybrid (sliding-window) model's pool adds, besides the reply's per-pool
sizes (``full_available``, ``swa_available``, ``swa_evictable``,
``swa_protected``), ``before_swa`` (those four before the first candidate)
and the array ``swa_pinned``: per
candidate, what its match took from the SWA evictable size (the SWA tail of
its prefix, now held for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from memsvc import protocol as p
from memsvc.core.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    OutOfRowsError,
)
from memsvc.sessions import NotOwnerError

if TYPE_CHECKING:
    from memsvc.core import KVPool
    from memsvc.sessions import Session, SessionTable

Reply = tuple[dict[str, Any], dict[str, np.ndarray] | None]

ADMIT_COLUMNS = (
    "row",
    "prefix_len",
    "device_hit",
    "host_hit",
    "storage_hit",
    "load_pending",
    "pinned",
)


def split_tokens(token_ids: np.ndarray, token_lens: np.ndarray) -> list[np.ndarray]:
    """The per-request token ids of a batch message (views of ``token_ids``)."""
    ends = np.cumsum(token_lens).tolist()
    starts = [0, *ends[:-1]]
    return [token_ids[s:e] for s, e in zip(starts, ends, strict=True)]


class BatchHandlers:
    """``admit``, ``cache_unfinished_many`` and ``release_many`` (see the module docstring)."""

    pool: KVPool
    sessions: SessionTable
    _row_session: np.ndarray

    if TYPE_CHECKING:

        def _own(self, session: Session, rid: str) -> None: ...
        def _sizes(self) -> dict[str, Any]: ...
        def _settle(self, *rids: str) -> None: ...

    def _own_open(self, session: Session, rids: list[str]) -> None:
        """Every rid is this session's and open (the batch ops' check, before any change)."""
        for rid in rids:
            self._own(session, rid)
            self.pool.request(rid)

    def _admit(self, session: Session, msg: p.Admit) -> Reply:
        pool = self.pool
        max_len = pool.table.max_context_len
        rids, not_owner = msg.rids, None
        for i, (rid, n) in enumerate(zip(msg.rids, msg.token_lens.tolist(), strict=True)):
            try:
                self.sessions.check_owner(session, rid)
            except NotOwnerError:  # the batch ends before it, untouched
                rids, not_owner = msg.rids[:i], rid
                break
            if pool.is_open(rid):
                raise DuplicateRequestError(f"request {rid!r} is already open")
            if n > max_len:
                raise InvalidArgumentError(f"{n} tokens exceed max_context_len {max_len}")
        sizes = self._sizes()
        before = [sizes["available"], sizes["evictable"], sizes["protected"], sizes["host_free"]]
        loads = pool.hicache is not None
        if pool.hicache is not None and msg.recompute_s_per_token is not None:
            pool.hicache.cost.observe_recompute(msg.recompute_s_per_token)
        opened: list[str] = []
        matches: list[tuple[int, ...]] = []
        hybrid = pool.swa is not None
        swa_keys = ("full_available", "swa_available", "swa_evictable", "swa_protected")
        before_swa = [sizes[key] for key in swa_keys] if hybrid else None
        swa_pinned: list[int] = []
        out_of_rows = False
        try:
            parts = split_tokens(msg.token_ids, msg.token_lens)
            namespaces = msg.namespaces or [""] * len(msg.rids)
            for rid, tokens, namespace in zip(rids, parts, namespaces, strict=False):
                try:
                    row = pool.open_request(rid, namespace)
                except OutOfRowsError:
                    out_of_rows = True
                    break
                opened.append(rid)
                self.sessions.claim(session, rid)
                self._row_session[row] = session.num
                available, evictable = pool.available_size(), pool.evictable_size()
                swa_evictable = pool.swa_evictable_size()
                match = pool.match_prefix_tiers(rid, tokens)
                pinned = evictable - pool.evictable_size()
                swa_pinned.append(swa_evictable - pool.swa_evictable_size())
                if loads:
                    pinned += available - pool.available_size()
                matches.append(
                    (
                        row,
                        match.prefix_len,
                        match.device_tokens,
                        match.host_tokens,
                        match.storage_tokens,
                        int(match.load_pending),
                        pinned,
                    )
                )
        except BaseException:
            for rid in reversed(opened):  # as free_row: their prefixes unlock
                pool.release(rid, is_insert=False)
            self._settle(*opened)
            raise
        table = np.array(matches, dtype=p.ARRAY_DTYPE).reshape(-1, len(ADMIT_COLUMNS))
        fields = {"out_of_rows": out_of_rows, "not_owner": not_owner, "before": before}
        arrays = {"matches": table.reshape(-1)}
        if hybrid:
            fields["before_swa"] = before_swa
            arrays["swa_pinned"] = np.array(swa_pinned[: len(matches)], dtype=p.ARRAY_DTYPE)
        return fields, arrays

    def _free_rows(self, session: Session, rids: list[str]) -> None:
        """``free_row`` for each of ``rids`` (all already checked)."""
        for rid in rids:
            self.pool.release(rid, is_insert=False)
        self._settle(*rids)

    def _cache_unfinished_many(self, session: Session, msg: p.CacheUnfinishedMany) -> Reply:
        self._own_open(session, msg.rids)
        parts = split_tokens(msg.token_ids, msg.token_lens)
        for rid, tokens in zip(msg.rids, parts, strict=True):
            self.pool.check_written_tokens(rid, tokens)  # all of them, before any changes
        prefix_lens = [
            self.pool.cache_unfinished(rid, tokens)
            for rid, tokens in zip(msg.rids, parts, strict=True)
        ]
        return {}, {"prefix_lens": np.array(prefix_lens, dtype=p.ARRAY_DTYPE)}

    def _release_many(self, session: Session, msg: p.ReleaseMany) -> Reply:
        """Each release in order, every inserted one's token ids checked first (the
        pool's rule: as many as its KV, or one fewer with a slot reserved ahead)."""
        self._own_open(session, msg.rids)
        parts = split_tokens(msg.token_ids, msg.token_lens)
        items = list(zip(msg.rids, msg.is_insert, parts, strict=True))
        for rid, insert, tokens in items:
            if insert:
                self.pool.check_written_tokens(rid, tokens)
        try:
            for rid, insert, tokens in items:
                self.pool.release(rid, tokens if insert else None, is_insert=insert)
        finally:
            self._settle(*msg.rids)
        return {}, None
