"""Sessions, leases, request ownership and the idempotency cache (pure, synchronous).

A client says ``hello`` and gets a session with a lease; any message from it
renews the lease. A session that stays silent past its lease is expired and
the service reclaims everything it held. Each request id belongs to the
session that opened it, for as long as the request holds a row or a
host-store entry. Replies to mutating ops are remembered per session by
``op_id``, with the request they answered (a window bounded in count and in
bytes, :class:`ReplyCache`), so a retried op is answered, not redone; an op_id
reused for a different message is refused.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from memsvc.core.errors import MemsvcError
from memsvc.reply_cache import ReplyCache

# Each session's window of replies: at most this many, and at most this many bytes
# (the newest always kept). memsvc --reply-cache-bytes sets the second.
REPLY_CACHE_SIZE = 4096
REPLY_CACHE_BYTES = 16 << 20


class UnknownSessionError(MemsvcError):
    """No such session: never opened, closed, or expired (or the service restarted)."""

    code = "unknown_session"


class TooManySessionsError(MemsvcError):
    """A hello while memsvc holds as many sessions as it takes (``--max-sessions``)."""

    code = "too_many_sessions"


class NotOwnerError(MemsvcError):
    """The request belongs to another session."""

    code = "not_owner"


class OpIdReusedError(MemsvcError):
    """An op_id this session already used, on a message that is not the one sent with it."""

    code = "op_id_reused"


# A request's frames, as received. A retry resends the very same bytes; keeping the
# frames (which exist anyway) costs nothing per op, where hashing them cost a pass
# over every byte of every mutating op (a CRC-32 and frame lengths until issue 28);
# they are compared only when an op_id comes again, and exactly.
Request = list[bytes]


@dataclass
class Session:
    sid: str
    num: int  # small integer id, for the per-row owner array
    role: str
    name: str
    lease_s: float
    last_seen: float
    rids: set[str] = field(default_factory=set)
    replies: ReplyCache[int, tuple[Request, list[bytes]]] = field(
        default_factory=lambda: ReplyCache(REPLY_CACHE_SIZE, REPLY_CACHE_BYTES)
    )
    checked_rows: tuple[bytes, int] | None = None  # last row batch that passed, and when
    # Its lease ran out while it held records a successor may adopt (memsvc.adoption):
    # kept until then, for ``adopt`` and ``goodbye`` alone.
    orphaned_at: float | None = None

    def expired(self, now: float) -> bool:
        return now - self.last_seen > self.lease_s


class SessionTable:
    def __init__(self, reply_cache_bytes: int = REPLY_CACHE_BYTES) -> None:
        self.reply_cache_bytes = reply_cache_bytes  # per session
        self._sessions: dict[str, Session] = {}
        self._owner_of: dict[str, Session] = {}
        self._next_num = 1

    def __len__(self) -> int:
        return len(self._sessions)

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def open(self, role: str, lease_s: float, name: str, now: float) -> Session:
        replies = ReplyCache(REPLY_CACHE_SIZE, self.reply_cache_bytes)
        num = self._next_num
        session = Session(secrets.token_hex(8), num, role, name, lease_s, now, replies=replies)
        self._next_num += 1
        self._sessions[session.sid] = session
        return session

    def touch(self, sid: str | None, now: float, op: str = "") -> Session:
        """The live session ``sid``, its lease renewed (an orphaned one only says goodbye)."""
        session = self._sessions.get(sid) if sid else None
        if session is not None and session.orphaned_at is not None and op != "goodbye":
            session = None
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

    def live(self) -> list[Session]:
        """The sessions that are not orphaned."""
        return [s for s in self._sessions.values() if s.orphaned_at is None]

    def find(self, sid: str) -> Session | None:
        """The live session ``sid`` (its lease not renewed), or None."""
        return self._sessions.get(sid)

    def transfer(self, old: Session, new: Session) -> None:
        """``old``'s requests become ``new``'s and ``old`` ends, nothing reclaimed
        (:mod:`memsvc.adoption`)."""
        self._sessions.pop(old.sid, None)
        for rid in old.rids:
            self._owner_of[rid] = new
        new.rids |= old.rids
        old.rids = set()

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
    def cached_reply(session: Session, op_id: int, request: Request) -> list[bytes] | None:
        """The first reply to ``op_id`` if ``request`` is a retry of it (the same frames).

        Raises :class:`OpIdReusedError` when ``op_id`` was used by another message:
        answering it with the first reply would report an op that never ran.
        """
        cached = session.replies.get(op_id)
        if cached is None:
            return None
        first_request, reply = cached
        if first_request != request:
            raise OpIdReusedError(
                f"op_id {op_id} was already used for another message in this session; "
                "a retry must resend the same message, a new op needs a new op_id"
            )
        return reply

    @staticmethod
    def remember_reply(session: Session, op_id: int, request: Request, reply: list[bytes]) -> None:
        """Keep ``reply`` for a retry of ``request`` (both kept as they are, not copied;
        both count against the session's byte bound)."""
        size = sum(map(len, reply)) + sum(map(len, request))
        session.replies.put(op_id, (request, reply), size)
