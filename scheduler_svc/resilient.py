"""A model client that survives a model_svc restart: the engine's ``model``, unchanged API.

:class:`ResilientModelClient` has the ``extend`` / ``decode`` / ``info`` /
``close`` of :class:`model_svc.client.AsyncModelClient` and wraps one. When a
forward call cannot complete because the worker died (its socket
disconnected: seen at once through a ZMQ socket monitor) or went silent
(:class:`PeerDeadError` after the client's own timeout and retries), it
waits for a worker to answer ``info`` again at the same address (the
supervisor restarts it), with backoff and bounded by ``recovery_timeout_s``,
and sends the *same* call again. That is safe because a forward pass writes
only the KV slots it is given: a re-run writes the same bytes and samples
the same tokens (sampling is seeded per request and position), so outputs do
not change. Error replies that say the message was damaged in transit
(``malformed`` / ``bad_request``) or that the worker could not reach memsvc
for a moment are re-sent the same way; anything else is raised. When no
worker comes back in time, :class:`WorkerUnavailableError` names the fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from memsvc.client import PeerDeadError
from memsvc.curve import CurveClientKeys
from model_svc.client import AsyncModelClient, ForwardError
from model_svc.errors import ModelSvcError

log = logging.getLogger("scheduler_svc")

# Error codes of a worker reply after which the same call is simply sent again.
RESEND_CODES = frozenset({"malformed", "bad_request", "peer_dead", "unknown_session"})
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0
PING_TIMEOUT_S = 5.0


class WorkerUnavailableError(ModelSvcError):
    """No model worker answered within the recovery timeout; the message says what failed."""

    code = "worker_unavailable"


class _Disconnected(Exception):
    """The worker's socket disconnected while a call was waiting for its reply."""


class ResilientModelClient:
    """``extend`` / ``decode`` that outlive a worker restart (see the module docstring).

    ``factory(timeout_s)`` builds the inner client (tests pass their own; the
    default one uses ``curve``); ``recovery_timeout_s`` bounds the wait for a
    worker to come back, per call.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 1,
        recovery_timeout_s: float = 120.0,
        factory: Callable[[float], AsyncModelClient] | None = None,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self._factory = factory or (
            lambda t: AsyncModelClient(address, timeout_s=t, retries=retries, curve=curve)
        )
        self._client = self._factory(timeout_s)
        self._monitor = _monitor(self._client)
        self.resends = 0  # forward calls sent again after a fault (for info / tests)

    # -- the AsyncModelClient API ---------------------------------------------

    async def info(self) -> Any:
        return await self._call("info", (), {})

    async def extend(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("extend", args, kwargs)

    async def decode(self, *args: Any, **kwargs: Any) -> Any:
        return await self._call("decode", args, kwargs)

    async def close(self) -> None:
        await self._drop_client()

    async def __aenter__(self) -> ResilientModelClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- fault handling --------------------------------------------------------

    async def _call(self, op: str, args: tuple, kwargs: dict) -> Any:
        deadline: float | None = None
        while True:
            _drain(self._monitor)  # a disconnect before this call is not about it
            try:
                return await self._race(getattr(self._client, op)(*args, **kwargs))
            except _Disconnected:
                fault = "its socket disconnected (worker died)"
            except PeerDeadError as exc:
                fault = f"no reply ({exc})"
            except ForwardError as exc:
                if exc.code not in RESEND_CODES:
                    raise
                fault = f"error reply {exc.code}: {exc}"
            if deadline is None:
                deadline = time.monotonic() + self.recovery_timeout_s
            log.warning("model_svc %s failed: %s; waiting for a worker to re-send it", op, fault)
            await self._wait_for_worker(deadline, fault)
            self.resends += 1

    async def _race(self, call: Any) -> Any:
        """Await ``call``; raise :class:`_Disconnected` if the socket drops first."""
        task = asyncio.ensure_future(call)
        if self._monitor is None:
            return await task
        watch = asyncio.ensure_future(self._monitor.recv_multipart())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watch.done():
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, PeerDeadError):
            await task
        raise _Disconnected

    async def _wait_for_worker(self, deadline: float, fault: str) -> None:
        """A fresh client once a worker answers ``info``; backoff, bounded by ``deadline``."""
        await self._drop_client()
        delay = BACKOFF_START_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerUnavailableError(
                    f"model_svc at {self.address} did not come back within "
                    f"{self.recovery_timeout_s:.0f}s after: {fault}"
                )
            probe = self._factory(min(PING_TIMEOUT_S, max(left, 0.1)))
            try:
                await probe.info()
            except (PeerDeadError, ForwardError):
                await probe.close()
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            await probe.close()
            break
        self._client = self._factory(self.timeout_s)
        self._monitor = _monitor(self._client)
        log.info("model_svc at %s answers again", self.address)

    async def _drop_client(self) -> None:
        client, monitor = self._client, self._monitor
        self._monitor = None
        if monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                _socket(client).disable_monitor()
            monitor.close(0)
        await client.close()


def _socket(client: AsyncModelClient) -> zmq.asyncio.Socket:
    return client._sock  # the inner client's one DEALER socket (same project)


def _monitor(client: AsyncModelClient) -> zmq.asyncio.Socket | None:
    """A socket that receives one message per disconnect of ``client``'s socket."""
    sock = getattr(client, "_sock", None)
    if sock is None:
        return None
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def _drain(monitor: zmq.asyncio.Socket | None) -> None:
    if monitor is None:
        return
    while True:  # an asyncio socket answers a NOBLOCK recv with a future that is already done
        future = monitor.recv_multipart(zmq.NOBLOCK)
        if not future.done():
            future.cancel()
            return
        if future.exception() is not None:
            return
