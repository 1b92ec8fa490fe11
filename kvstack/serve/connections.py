"""The front's connections, capped: a slow client gives way to a new one.

Every connection is a file descriptor. aiohttp times out a connection whose
request headers do not come (its ``keepalive_timeout``, set from
``--http-header-timeout``) and the front times bodies (``--http-body-timeout``),
but nothing in aiohttp caps how many connections are open at once: slow
clients could hold every descriptor until those timeouts, and at the
open-file limit the server accepts nobody, ``/health`` included.

:class:`ConnectionGuard` stands between the listening socket and aiohttp's
protocol (:meth:`ConnectionGuard.protocol_factory`). It holds at most
``max_connections``; the application tells it what each connection is doing
(:meth:`~ConnectionGuard.busy`, :meth:`~ConnectionGuard.receiving`,
:meth:`~ConnectionGuard.waiting`), by its transport::

    WAITING    no request in a handler: new and sending its headers, or kept alive
    RECEIVING  a handler is reading the request's body
    BUSY       a handler is working on the request

Past the cap, a new connection closes the one that has been WAITING or
RECEIVING longest (a client that sends slowly loses its place to one that
sends at once); when every connection is BUSY, the new one is answered 503
and closed. Closed connections are not logged one by one, only summed up
once a minute at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

log = logging.getLogger("kvstack.http")

REPORT_INTERVAL_S = 60.0


def _busy_reply(max_connections: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the server holds its most connections ({max_connections}, "
                "--max-connections), all with requests in progress; retry later",
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Connection(asyncio.Protocol):
    """One accepted connection: the guard's bookkeeping in front of aiohttp's protocol
    (made only once the connection is admitted)."""

    def __init__(self, guard: ConnectionGuard, make: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make = make
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self._guard._admit(self):
            self.inner = self._make()
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard._forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)


class ConnectionGuard:
    """At most ``max_connections`` open; the longest WAITING or RECEIVING one closed for a
    new one past the cap (see the module's docstring)."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._open: dict[object, _Connection] = {}  # by transport
        # WAITING or RECEIVING, the longest first: who gives way to a new connection
        self._yielding: OrderedDict[_Connection, None] = OrderedDict()
        self.num_closed_for_newer = 0
        self.num_refused = 0
        self._reported = (0, 0)
        self._report_at = 0.0

    @property
    def num_open(self) -> int:
        return len(self._open)

    def protocol_factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], _Connection]:
        """A protocol factory for ``loop.create_server``: ``make``'s protocols, guarded."""
        return lambda: _Connection(self, make)

    # -- what the application says ---------------------------------------------------------

    def busy(self, transport: object) -> None:
        conn = self._open.get(transport)
        if conn is not None:
            self._yielding.pop(conn, None)

    def waiting(self, transport: object) -> None:
        conn = self._open.get(transport)
        if conn is not None:
            self._yielding[conn] = None
            self._yielding.move_to_end(conn)

    @contextlib.contextmanager
    def receiving(self, transport: object) -> Iterator[None]:
        """RECEIVING while the body is read, then BUSY again."""
        self.waiting(transport)
        try:
            yield
        finally:
            self.busy(transport)

    # -- the connections' side -------------------------------------------------------------

    def _admit(self, conn: _Connection) -> bool:
        assert conn.transport is not None
        if len(self._open) >= self.max_connections:
            if not self._yielding:
                self.num_refused += 1
                conn.transport.write(_busy_reply(self.max_connections))
                conn.transport.close()
                self._report()
                return False
            oldest, _ = self._yielding.popitem(last=False)
            self._forget(oldest)
            if oldest.transport is not None:
                oldest.transport.abort()  # its descriptor goes now, not after a flush
            self.num_closed_for_newer += 1
            self._report()
        self._open[conn.transport] = conn
        self._yielding[conn] = None
        return True

    def _forget(self, conn: _Connection) -> None:
        if self._open.get(conn.transport) is conn:
            del self._open[conn.transport]
        self._yielding.pop(conn, None)

    def _report(self) -> None:
        now = time.monotonic()
        if now < self._report_at:
            return
        closed = self.num_closed_for_newer - self._reported[0]
        refused = self.num_refused - self._reported[1]
        log.warning(
            "at the connection cap (%d, --max-connections): %d slow connections closed for "
            "newer ones, %d refused (503) since the last such report (at most one a %g s)",
            self.max_connections,
            closed,
            refused,
            REPORT_INTERVAL_S,
        )
        self._reported = (self.num_closed_for_newer, self.num_refused)
        self._report_at = now + REPORT_INTERVAL_S
