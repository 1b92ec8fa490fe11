"""Request / reply over a DEALER socket, with a timeout and retries, sync and asyncio.

Shared by every kvstack client (memsvc's, model_svc's). A request is sent,
its reply matched by ``op_id`` (a late reply to an earlier try is skipped),
and after ``retries + 1`` silent timeouts :class:`NoReplyError` says so: a
dead or stalled peer is an error, never a hang. Retrying is safe because
every server answers a repeated ``op_id`` without acting twice (memsvc from
its reply cache, model_svc because forward passes are idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import zmq
import zmq.asyncio

from memsvc import protocol as p
from memsvc.curve import CurveClientKeys, make_client


class NoReplyError(TimeoutError):
    """The peer did not answer within the timeout, through every retry."""


def dealer(ctx: zmq.Context, address: str, curve: CurveClientKeys | None = None) -> zmq.Socket:
    """A connected DEALER socket, a CURVE client of ``address`` if ``curve`` is given."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    make_client(sock, curve)
    sock.connect(address)
    return sock


def send_or_drop(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send without blocking; False if the message was dropped.

    A DEALER has nowhere to queue once a server's CURVE refused it (its
    connection is gone until the next try), and a blocking send would then
    wait for ever. A dropped request is a request that gets no reply: the
    caller's timeout and retries handle it like any other.
    """
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


class Requester:
    """:func:`request` over one DEALER socket, remembering the receive timeout it set.

    The timeout only changes on a retry or after a stale reply, so the hot
    path is a send and one blocking receive, without a ``setsockopt`` each
    time. Not thread-safe (nor is the socket).
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._rcvtimeo_ms: int | None = None

    def _wait_at_most(self, seconds: float) -> None:
        ms = max(1, int(seconds * 1000))
        if ms != self._rcvtimeo_ms:
            self.sock.setsockopt(zmq.RCVTIMEO, ms)
            self._rcvtimeo_ms = ms

    def request(
        self, frames: list[bytes], op_id: int, timeout_s: float, retries: int
    ) -> dict[str, Any]:
        """Send ``frames`` and return the decoded reply to ``op_id``."""
        sock = self.sock
        for _ in range(retries + 1):
            send_or_drop(sock, frames)
            deadline = time.monotonic() + timeout_s
            left = timeout_s
            while left > 0:
                # A blocking recv with a timeout: one wait, not a poll and then a recv.
                self._wait_at_most(left)
                try:
                    header = p.unpack(sock.recv_multipart())
                except zmq.Again:
                    break
                except p.ProtocolError:
                    header = None  # damaged in transit is no reply: keep waiting, then retry
                if header is not None and header.get("op_id") == op_id:
                    return header
                left = deadline - time.monotonic()
        raise NoReplyError(f"no reply within {retries + 1} x {timeout_s:.1f}s")


def request(
    sock: zmq.Socket, frames: list[bytes], op_id: int, timeout_s: float, retries: int
) -> dict[str, Any]:
    """Send ``frames`` and return the decoded reply to ``op_id``."""
    return Requester(sock).request(frames, op_id, timeout_s, retries)


class AsyncRequester:
    """:class:`Requester` for asyncio, over a plain DEALER socket (not a ``zmq.asyncio`` one).

    ``zmq.asyncio`` wraps each send, poll and receive in futures and a poller of
    its own, and :func:`request_async` needs a poll and a receive per reply:
    about 100 µs a request over the sync client (issue 28). Here the send and the
    receives are non-blocking calls on the socket, and the wait between them is
    one future, woken by a reader on the socket's file descriptor that is
    registered with the event loop once. That descriptor only signals that the
    socket's state changed (edge-triggered), so ``ZMQ_EVENTS`` is read before
    each wait (a reply may already be queued) and by the reader (which resets
    the descriptor). One request at a time (the caller serializes them), in one
    event loop at a time; :meth:`close` before the socket is closed.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None

    def _on_readable(self) -> None:
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _watch(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self.close()
            loop.add_reader(self._fd, self._on_readable)
            self._loop = loop
        return loop

    async def _readable(self, loop: asyncio.AbstractEventLoop, deadline: float) -> bool:
        """Wait until a message is queued (True) or ``deadline`` (loop time) passes (False)."""
        sock = self.sock
        while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if loop.time() >= deadline:
                return False
            waiter = self._waiter = loop.create_future()
            timer = loop.call_at(deadline, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        return True

    async def request(
        self, frames: list[bytes], op_id: int, timeout_s: float, retries: int
    ) -> dict[str, Any]:
        """Send ``frames`` and return the decoded reply to ``op_id``."""
        sock = self.sock
        loop = self._watch()
        for _ in range(retries + 1):
            send_or_drop(sock, frames)
            deadline = loop.time() + timeout_s
            while await self._readable(loop, deadline):
                try:
                    header = p.unpack(sock.recv_multipart(zmq.NOBLOCK))
                except (zmq.Again, p.ProtocolError):
                    continue  # a reply damaged in transit is no reply: keep waiting, then retry
                if header.get("op_id") == op_id:
                    return header
        raise NoReplyError(f"no reply within {retries + 1} x {timeout_s:.1f}s")

    def close(self) -> None:
        """Stop watching the socket (its event loop's reader goes)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def request_async(
    sock: zmq.asyncio.Socket, frames: list[bytes], op_id: int, timeout_s: float, retries: int
) -> dict[str, Any]:
    """:func:`request` for asyncio sockets (one request in flight per socket)."""
    for _ in range(retries + 1):
        with contextlib.suppress(zmq.Again):  # as in send_or_drop
            await sock.send_multipart(frames, zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not await sock.poll(left * 1000):
                break
            try:
                header = p.unpack(await sock.recv_multipart())
            except p.ProtocolError:
                continue  # a reply damaged in transit is no reply: keep waiting, then retry
            if header.get("op_id") == op_id:
                return header
    raise NoReplyError(f"no reply within {retries + 1} x {timeout_s:.1f}s")
