"""Sessions, leases, request ownership and the idempotency cache (pure, synchronous).

A client says ``hello`` and gets a session with a lease; any message from it
renews the lease. A session that stays silent past its lease is expired and
the service reclaims everything it held. Each request id belongs to the
session that opened it, for as long as the request holds a row or a
host-store entry. Replies to mutating ops are remembered per session by
``op_id`` (a bounded window), so a retried op is answered, not redone.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from memsvc.core.errors import MemsvcError

REPLY_CACHE_SIZE = 4096


class UnknownSessionError(MemsvcError):
    """No such session: never opened, closed, or expired (or the service restarted)."""

    code = "unknown_session"


class NotOwnerError(MemsvcError):
    """The request belongs to another session."""

    code = "not_owner"


@dataclass
class Session:
    sid: str
    num: int  # small integer id, for the per-row owner array
    role: str
    name: str
    lease_s: float
    last_seen: float
    rids: set[str] = field(default_factory=set)
    replies: OrderedDict[int, list[bytes]] = field(default_factory=OrderedDict)
    checked_rows: tuple[bytes, int] | None = None  # last row batch that passed, and when

    def expired(self, now: float) -> bool:
        return now - self.last_seen > self.lease_s


class SessionTable:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._owner_of: dict[str, Session] = {}
        self._next_num = 1

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def open(self, role: str, lease_s: float, name: str, now: float) -> Session:
        session = Session(secrets.token_hex(8), self._next_num, role, name, lease_s, now)
        self._next_num += 1
        self._sessions[session.sid] = session
        return session

    def touch(self, sid: str | None, now: float) -> Session:
        """The live session ``sid``, its lease renewed."""
        session = self._sessions.get(sid) if sid else None
        if session is None:
            raise UnknownSessionError(
                f"unknown session {sid!r}: say hello first (it may have expired, "
                "or memsvc restarted)"
            )
        session.last_seen = now
        return session

    def close(self, session: Session) -> list[str]:
        """Forget the session; returns the request ids it still owned."""
        self._sessions.pop(session.sid, None)
        for rid in session.rids:
            self._owner_of.pop(rid, None)
        return sorted(session.rids)

    def expired(self, now: float) -> list[Session]:
        return [s for s in self._sessions.values() if s.expired(now)]

    # -- ownership -------------------------------------------------------------

    def check_owner(self, session: Session, rid: str) -> None:
        owner = self._owner_of.get(rid)
        if owner is not None and owner is not session:
            raise NotOwnerError(f"request {rid!r} belongs to another session")

    def claim(self, session: Session, rid: str) -> None:
        self.check_owner(session, rid)
        self._owner_of[rid] = session
        session.rids.add(rid)

    def unclaim(self, rid: str) -> None:
        owner = self._owner_of.pop(rid, None)
        if owner is not None:
            owner.rids.discard(rid)

    # -- idempotency -----------------------------------------------------------

    @staticmethod
    def cached_reply(session: Session, op_id: int) -> list[bytes] | None:
        return session.replies.get(op_id)

    @staticmethod
    def remember_reply(session: Session, op_id: int, reply: list[bytes]) -> None:
        session.replies[op_id] = reply
        if len(session.replies) > REPLY_CACHE_SIZE:
            session.replies.popitem(last=False)
