"""Durable request records, and a restarted scheduler's adoption of its predecessor.

The KV of a scheduler's requests lives in memsvc, which outlives the
scheduler. For a successor to go on decoding from that KV (no re-prefill), it
also needs the requests themselves; the scheduler keeps them here, in its
session, as :class:`Record`\\ s:

- ``commit`` (:class:`~memsvc.protocol.Commit`) opens records (the scheduler's
  opaque ``meta``, with the prompt's length), appends each record's new output
  tokens (append-only: a record's ``offset`` must be its length) with an opaque
  chunk of the scheduler's per token (its logprobs, ``extras``), says how many
  of its KV positions are known written (``kv_committed``) and closes records.
  memsvc stamps ``kv_committed`` with the row it was said of (the open
  request's :class:`~memsvc.core.pool.ReqKV`, an object made anew each time the
  rid opens a row): a later row of the same rid (a re-admission) is never taken
  for written. Every check comes before any change: a bad commit changes nothing.
- ``adopt`` (:class:`~memsvc.protocol.Adopt`): a new session presents its dead
  predecessor's session id (a secret the scheduler keeps in a private file),
  with the same role and name; it must hold nothing yet. In one op the
  predecessor's rids, rows, host-store entries, prefix locks and records
  become the new session's, and the predecessor's session ends without a
  reclaim. Each record's KV is judged (:func:`_judge`): a row stamped by the
  last commit is cut back to its committed positions (the step in flight when
  the scheduler died is discarded; the slots past them are freed), a host-store
  entry is kept if it holds exactly the committed positions, anything else is
  freed (its tokens counted in ``freed_tokens``: the successor recomputes them).

Records are bounded per session (:data:`MAX_RECORDS`, :data:`MAX_RECORD_BYTES`). A
session whose lease runs out while it holds records is not reclaimed at once: it
is kept, answering only ``adopt`` and ``goodbye``, for :data:`ADOPTION_WINDOW_S`
(a restart may take longer than the lease), then reclaimed as any.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from memsvc import protocol as p
from memsvc.core.allocator import SLOT_DTYPE
from memsvc.core.errors import InvalidArgumentError, MemsvcError

log = logging.getLogger("memsvc")

if TYPE_CHECKING:
    from memsvc.handlers import MemService
    from memsvc.sessions import Session

# A scheduler session whose lease runs out while it holds records is kept this long
# for a successor to adopt (its restart may take longer than the lease), then reclaimed.
ADOPTION_WINDOW_S = 60.0
# Per session: a scheduler records each live request once (max_running_requests plus
# its waiting queue); the bytes bound the prompts and outputs they carry.
MAX_RECORDS = 16384
MAX_RECORD_BYTES = 64 << 20
RECORD_OVERHEAD_BYTES = 64  # counted per record on top of its meta and tokens


class AdoptRefusedError(MemsvcError):
    """``adopt`` refused: no such predecessor, or not one this session may take over."""

    code = "adopt_refused"


class RecordLimitError(MemsvcError):
    """A commit would make the session hold more records (or bytes of them) than allowed."""

    code = "record_limit"


@dataclass(slots=True)
class Record:
    """One request as its scheduler committed it."""

    rid: str
    meta: bytes  # the scheduler's own record, opaque here
    prompt_len: int
    outputs: list[int] = field(default_factory=list)
    kv_committed: int = 0  # KV positions known written, of the row ``kv_row``
    kv_row: object | None = None  # the ReqKV the commit saw (identity: that row)
    retractions: int = 0
    extras: list[bytes] = field(default_factory=list)  # the scheduler's chunks, in order

    @property
    def nbytes(self) -> int:
        extras = sum(map(len, self.extras))
        return len(self.meta) + 8 * len(self.outputs) + extras + RECORD_OVERHEAD_BYTES


@dataclass
class Journal:
    """One session's records."""

    records: dict[str, Record] = field(default_factory=dict)
    nbytes: int = 0
    ratio: float | None = None  # the scheduler's new_token_ratio, as of its last commit


class Journals:
    """Every session's :class:`Journal`, by session id."""

    def __init__(
        self,
        max_records: int = MAX_RECORDS,
        max_bytes: int = MAX_RECORD_BYTES,
        window_s: float = ADOPTION_WINDOW_S,
    ) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.window_s = window_s
        self._by_session: dict[str, Journal] = {}

    def of(self, sid: str) -> Journal:
        return self._by_session.setdefault(sid, Journal())

    def get(self, sid: str) -> Journal | None:
        return self._by_session.get(sid)

    def forget(self, sid: str) -> None:
        self._by_session.pop(sid, None)

    def move(self, old: str, new: str) -> Journal:
        journal = self._by_session.pop(old, None) or Journal()
        self._by_session[new] = journal
        return journal


def keep_for_adoption(service: MemService, session: Session, now: float) -> bool:
    """Whether ``session``, whose lease ran out, is kept (orphaned) for a successor to
    adopt instead of being reclaimed now: it holds records, and its adoption window
    (``window_s`` from the expiry) is still open. An orphaned session answers nothing
    but ``adopt`` (by its successor) and ``goodbye``."""
    journal = service.journals.get(session.sid)
    if journal is None or not journal.records:
        return False
    if session.orphaned_at is None:
        session.orphaned_at = now
        log.warning(
            "session %s (%s %s) expired with %d request records: kept %.0fs for adoption",
            session.sid,
            session.role,
            session.name,
            len(journal.records),
            service.journals.window_s,
        )
    return now - session.orphaned_at < service.journals.window_s


# -- commit ----------------------------------------------------------------------


def commit(service: MemService, session: Session, msg: p.Commit) -> dict[str, Any]:
    """Apply ``msg`` to the session's journal, all or nothing (see the module docstring)."""
    journal = service.journals.of(session.sid)
    records = journal.records
    added = _check_new(service, session, msg, records)
    rows = _check_appends(service, session, msg, records, added)
    dropped = [records[rid] for rid in msg.drop if rid in records]
    missing = [rid for rid in msg.drop if rid not in records and rid not in added]
    if missing:
        raise InvalidArgumentError(f"commit: no record to drop for {missing[:3]}")
    num_tokens = msg.token_ids.size if msg.rids else 0
    growth = sum(r.nbytes for r in added.values()) + 8 * num_tokens + sum(map(len, msg.extras))
    growth -= sum(r.nbytes for r in dropped)
    count = len(records) + len(added) - len(dropped)
    if count > service.journals.max_records or journal.nbytes + growth > service.journals.max_bytes:
        raise RecordLimitError(
            f"commit would hold {count} records / {journal.nbytes + growth} bytes in this "
            f"session, over {service.journals.max_records} / {service.journals.max_bytes}"
        )
    # -- every check passed: apply
    records.update(added)
    if msg.rids:
        entries = msg.entries.reshape(-1, p.COMMIT_ENTRY_FIELDS).tolist()
        tokens = msg.token_ids.tolist()
        extras = msg.extras or [b""] * len(msg.rids)
        start = 0
        for rid, (_, num, kv_committed, retractions), row, extra in zip(
            msg.rids, entries, rows, extras, strict=True
        ):
            record = records[rid]
            record.outputs += tokens[start : start + num]
            if extra:
                record.extras.append(extra)
            start += num
            record.kv_committed, record.kv_row = kv_committed, row
            record.retractions = retractions
    for rid in msg.drop:
        del records[rid]
    journal.nbytes += growth
    if msg.ratio is not None:
        journal.ratio = msg.ratio
    return {"records": len(records)}


def _check_new(
    service: MemService, session: Session, msg: p.Commit, records: dict[str, Record]
) -> dict[str, Record]:
    added = {}
    for rid, meta, prompt_len in zip(msg.new_rids, msg.new_meta, msg.new_prompt_lens, strict=True):
        if rid in records:
            raise InvalidArgumentError(f"commit: request {rid!r} already has a record")
        if prompt_len < 1:
            raise InvalidArgumentError(f"commit: request {rid!r} has prompt_len {prompt_len}")
        service.sessions.check_owner(session, rid)
        added[rid] = Record(rid, meta, prompt_len)
    return added


def _check_appends(
    service: MemService,
    session: Session,
    msg: p.Commit,
    records: dict[str, Record],
    added: dict[str, Record],
) -> list[object | None]:
    """The row each entry's ``kv_committed`` is said of (None: none), after checking it.

    Runs on every decode step: the per-rid loop does dict lookups only (a rid in
    ``session.rids`` is owned by the session).
    """
    if not msg.rids:
        return []
    table = msg.entries.reshape(-1, p.COMMIT_ENTRY_FIELDS)
    if (table[:, 1] < 0).any() or int(table[:, 1].sum()) != msg.token_ids.size:
        raise InvalidArgumentError(
            "commit: token counts must be >= 0 and add up to the size of token_ids"
        )
    pool = service.pool
    owned = session.rids
    rows: list[object | None] = []
    for rid, (offset, num, kv_committed, retractions) in zip(msg.rids, table.tolist(), strict=True):
        record = records.get(rid) or added.get(rid)
        if record is None:
            raise InvalidArgumentError(f"commit: no record for {rid!r} (open it with new_rids)")
        if offset != len(record.outputs):
            raise InvalidArgumentError(
                f"commit: {rid!r} has {len(record.outputs)} committed outputs; an append must "
                f"start there (got offset {offset})"
            )
        if retractions < record.retractions:
            raise InvalidArgumentError(f"commit: {rid!r}'s retract count cannot go down")
        if not 0 <= kv_committed < record.prompt_len + offset + num:
            raise InvalidArgumentError(
                f"commit: {rid!r} cannot have {kv_committed} KV positions written at "
                f"sequence length {record.prompt_len + offset + num}"
            )
        row = None
        if kv_committed:
            if rid not in owned or not pool.is_open(rid):
                raise InvalidArgumentError(f"commit: {rid!r} holds no row in this session")
            row = pool.request(rid)
            if row.kv_len < kv_committed:
                raise InvalidArgumentError(
                    f"commit: {rid!r} has {row.kv_len} KV positions, not {kv_committed}"
                )
        rows.append(row)
    return rows


# -- adopt -----------------------------------------------------------------------


@dataclass(slots=True)
class _Verdict:
    kv: str  # "row" (decode on), "host" (load back from the host store) or "none"
    row: int = -1
    kv_len: int = 0


def adopt(service: MemService, session: Session, msg: p.Adopt) -> dict[str, Any]:
    """Move the predecessor's session into ``session`` (see the module docstring)."""
    old = _predecessor(service, session, msg.predecessor)
    journal = service.journals.move(old.sid, session.sid)
    pool = service.pool
    service.sessions.transfer(old, session)
    rows = [pool.request(rid).row for rid in session.rids if pool.is_open(rid)]
    service.adopt_rows(session, rows)
    verdicts: dict[str, _Verdict] = {}
    freed = trimmed = 0
    for rid, record in journal.records.items():
        verdict, lost, cut = _judge(service, session, record)
        verdicts[rid] = verdict
        freed += lost
        trimmed += cut
    for rid in sorted(session.rids - set(journal.records)):  # KV of requests not recorded
        freed += _free(service, rid)
    service.settle_rids(*sorted(session.rids))
    out = []
    for rid, record in journal.records.items():
        verdict = verdicts[rid]
        out.append(
            {
                "rid": rid,
                "meta": record.meta,
                "outputs": record.outputs,
                "retractions": record.retractions,
                "extras": record.extras,
                "kv": verdict.kv,
                "row": verdict.row,
                "kv_len": verdict.kv_len,
            }
        )
    return {
        "records": out,
        "ratio": journal.ratio,
        "freed_tokens": freed,
        "trimmed_tokens": trimmed,
    }


def _predecessor(service: MemService, session: Session, sid: str) -> Session:
    """The session ``session`` may adopt, or :class:`AdoptRefusedError` (nothing changed)."""
    old = service.sessions.find(sid)
    if old is None or old is session:
        raise AdoptRefusedError(
            "no session to adopt under that id (a wrong id, or it ended: its lease ran out, "
            "it said goodbye, or memsvc restarted)"
        )
    if (old.role, old.name) != (session.role, session.name):
        raise AdoptRefusedError(
            f"a {session.role} {session.name!r} session cannot adopt a {old.role} {old.name!r} one"
        )
    journal = service.journals.get(session.sid)
    if session.rids or (journal is not None and journal.records):
        raise AdoptRefusedError("only a session that holds nothing yet may adopt another")
    return old


def _judge(service: MemService, session: Session, record: Record) -> tuple[_Verdict, int, int]:
    """What the successor gets of ``record``'s KV: (verdict, tokens freed, slots trimmed)."""
    pool = service.pool
    rid = record.rid
    committed = record.prompt_len + len(record.outputs) - 1  # positions written, if decoding
    if pool.is_open(rid):
        kv = pool.request(rid)
        usable = (
            record.outputs
            and kv is record.kv_row
            and record.kv_committed == committed
            and kv.protected_len <= committed <= kv.kv_len
            and (pool.swa is None or kv.kv_len == committed)
        )
        if not usable:
            return _Verdict("none"), _free(service, rid), 0
        cut = kv.kv_len - committed
        _trim(service, kv, committed)
        return _Verdict("row", kv.row, committed), 0, cut
    if rid in pool.host_store:
        if record.outputs and pool.host_store.num_tokens(rid) == committed:
            return _Verdict("host", -1, committed), 0, 0
        return _Verdict("none"), _free(service, rid), 0
    return _Verdict("none"), 0, 0


def _trim(service: MemService, kv: Any, kv_len: int) -> None:
    """Cut ``kv``'s row back to ``kv_len`` positions: free the pages wholly past it
    (the row's own: ``kv_len >= protected_len``) and clear their table entries.

    ::

        row: | protected (tree) | own, written (kept) | in flight / reserved (freed) |
             0           protected_len             kv_len                    kv.kv_len
    """
    pool = service.pool
    end = kv.kv_len
    if end == kv_len:
        return
    page = pool.page_size
    first_free = -(-kv_len // page) * page  # the first position on a page of its own
    if first_free < end:
        pool.allocator.free(pool.table.read(kv.row, first_free, end), owner=kv.row)
    pool.table.write(kv.row, kv_len, np.zeros(end - kv_len, dtype=SLOT_DTYPE))
    kv.kv_len = kv_len


def _free(service: MemService, rid: str) -> int:
    """Free ``rid``'s row and host-store entry; returns the tokens of KV they held (its
    own: a locked tree prefix stays in the tree)."""
    pool = service.pool
    tokens = 0
    if service.transfer is not None:  # a PD decode node's room awaiting its KV: closed
        service.transfer.forget_rid(rid)
    if pool.is_open(rid):
        kv = pool.request(rid)
        tokens += kv.kv_len - kv.protected_len
        pool.release(rid, is_insert=False)
    if rid in pool.host_store:
        tokens += pool.host_store.num_tokens(rid)
        pool.host_discard(rid)
    return tokens


def held_tokens(service: MemService, rids: list[str]) -> int:
    """Tokens of KV ``rids`` hold (their own rows' and host-store entries')."""
    pool = service.pool
    tokens = 0
    for rid in rids:
        if pool.is_open(rid):
            kv = pool.request(rid)
            tokens += kv.kv_len - kv.protected_len
        if rid in pool.host_store:
            tokens += pool.host_store.num_tokens(rid)
    return tokens
