"""Clients of memsvc: :class:`MemClient` (sync) and :class:`AsyncMemClient` (asyncio).

Both speak the same protocol through the same op definitions (:class:`_Ops`);
only the way a message is sent and its reply awaited differs. Every call has
a timeout and is retried with the same ``op_id`` (the service answers a
retried mutating op from its reply cache, so it is never applied twice). A
service that stays silent through every retry raises :class:`PeerDeadError`;
one that restarted (a new epoch) raises :class:`EpochChangedError`. Neither
ever hangs. Heartbeats keep the session's lease alive in the background and
stop with :meth:`close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from memsvc import protocol as p
from memsvc import rpc
from memsvc.core import errors
from memsvc.core.backends import AttachedBuffers
from memsvc.core.backends import attach as attach_handle
from memsvc.core.layout import PoolLayout
from memsvc.curve import CurveClientKeys
from memsvc.ops import (
    AdmitMatch,
    AdmitResult,
    AllocResult,
    PoolSizes,
    PrefixMatch,
    RetractReply,
    _Call,
    _nothing,
    _Ops,
)
from memsvc.protocol import RetractTarget
from memsvc.sessions import NotOwnerError, UnknownSessionError

__all__ = [
    "AdmitMatch",
    "AdmitResult",
    "AllocResult",
    "AsyncMemClient",
    "Call",
    "ClientSession",
    "CurveClientKeys",
    "EpochChangedError",
    "MemClient",
    "MemClientBase",
    "PeerDeadError",
    "PoolSizes",
    "PrefixMatch",
    "RequestRejectedError",
    "RetractReply",
    "RetractTarget",
    "attach",
]


class PeerDeadError(errors.MemsvcError):
    """memsvc did not answer within the timeout, through every retry."""

    code = "peer_dead"


class EpochChangedError(errors.MemsvcError):
    """memsvc restarted: its pool is new and empty, this session is gone."""

    code = "epoch_changed"

    def __init__(self, message: str, new_epoch: str | None) -> None:
        super().__init__(message)
        self.new_epoch = new_epoch


class RequestRejectedError(errors.MemsvcError):
    """The service could not parse or validate the request (malformed, bad field, too large)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _error_classes() -> dict[str, type[errors.MemsvcError]]:
    found: dict[str, type[errors.MemsvcError]] = {}
    pending = [errors.MemsvcError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


Call = _Call
"""One request to make: op name, header fields, array frames, and the reply's parser."""

_ERRORS_BY_CODE = {
    **_error_classes(),
    "unknown_session": UnknownSessionError,
    "not_owner": NotOwnerError,
}


class ClientSession:
    """The state every client keeps: ids, epoch, layout, and reply checking.

    A transport (a socket, or :class:`memsvc.inproc.InProcessMem`'s direct call)
    packs a :class:`Call` with :meth:`frames`, delivers it, and hands the
    unpacked reply header to :meth:`finish`, which checks it and parses the
    result. Open a session by sending :meth:`hello_call` first.
    """

    def __init__(
        self,
        address: str,
        role: str,
        name: str,
        lease_s: float,
        timeout_s: float,
        retries: int,
        curve: CurveClientKeys | None,
    ) -> None:
        self.address = address
        self.role = role
        self.name = name
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.retries = retries
        self.curve = curve
        self.session: str | None = None
        self.epoch: str | None = None
        self.layout: PoolLayout | None = None
        self.handle: dict[str, Any] | None = None
        self.hello_info: dict[str, Any] = {}
        self.sizes: PoolSizes | None = None  # as of the last reply
        self._op_ids = itertools.count(1)

    def new_socket(self, ctx: zmq.Context) -> zmq.Socket:
        return rpc.dealer(ctx, self.address, self.curve)

    def frames(self, call: _Call) -> tuple[int, list[bytes]]:
        op_id = next(self._op_ids)
        header = {"op": call.op, "op_id": op_id, "session": self.session, **call.fields}
        return op_id, p.pack(header, call.arrays)

    def hello_call(self) -> _Call:
        return _Call(
            "hello",
            {"role": self.role, "lease_s": self.lease_s, "name": self.name},
            None,
            self._welcome,
        )

    def _welcome(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.session = header["session"]
        self.epoch = header["epoch"]
        self.layout = PoolLayout.from_dict(header["layout"])
        self.handle = header["handle"]
        self.hello_info = header

    def finish(self, call: _Call, header: dict[str, Any]) -> Any:
        arrays = {name: value for name, value in header.items() if type(value) is np.ndarray}
        for name in arrays:
            del header[name]
        epoch = header.get("epoch")
        if epoch != self.epoch and self.epoch is not None and call.op != "hello":
            raise EpochChangedError(
                f"memsvc at {self.address} restarted (epoch {self.epoch} -> {epoch}): its pool "
                "is empty and this session is gone; reconnect and treat held KV as lost",
                epoch,
            )
        if "swa_available" in header:  # a hybrid pool: both pools' sizes
            self.sizes = PoolSizes(
                header["available"],
                header["evictable"],
                header["protected"],
                header["host_free"],
                header["full_available"],
                header["swa_available"],
                header["swa_evictable"],
                header["swa_protected"],
            )
        else:
            self.sizes = PoolSizes(
                header["available"], header["evictable"], header["protected"], header["host_free"]
            )
        if not header.get("ok"):
            code, message = header.get("code", "internal"), header.get("message", "")
            cls = _ERRORS_BY_CODE.get(code)
            if cls is None:
                raise RequestRejectedError(code, message)
            raise cls(message)
        return call.parse(header, arrays)

    def dead(self, call: _Call) -> PeerDeadError:
        return PeerDeadError(
            f"memsvc at {self.address} did not answer {call.op!r} within "
            f"{self.retries + 1} x {self.timeout_s:.1f}s"
        )


class MemClientBase(_Ops):
    """Every memsvc op, and what a client exposes of its session (set by ``hello``).

    A client subclasses it, keeps its :class:`ClientSession` in ``_state`` and
    implements ``_invoke(call)``: deliver one :class:`Call`, return
    ``self._state.finish(call, reply_header)``.
    """

    _state: ClientSession

    session = property(lambda self: self._state.session)
    epoch = property(lambda self: self._state.epoch)
    layout = property(lambda self: self._state.layout)
    handle = property(lambda self: self._state.handle)
    sizes = property(lambda self: self._state.sizes)
    hello_info = property(lambda self: self._state.hello_info)

    def attach(self) -> AttachedBuffers:
        """Zero-copy views (numpy and torch) of the KV buffers and ``req_to_token``."""
        return attach_handle(self._state.handle)


class _SocketClient(MemClientBase):
    """A client over a ZMQ socket: its session, context and socket, set up alike for
    the blocking and the asyncio client."""

    _new_context: Callable[[], zmq.Context] = zmq.Context

    def __init__(
        self,
        address: str,
        *,
        role: str = "scheduler",
        name: str = "",
        lease_s: float = 10.0,
        timeout_s: float = 5.0,
        retries: int = 2,
        heartbeat: bool = True,
        curve: CurveClientKeys | None = None,
    ) -> None:
        self._state = ClientSession(address, role, name, lease_s, timeout_s, retries, curve)
        self._want_heartbeat = heartbeat
        self._ctx = self._new_context()
        self._sock = self._state.new_socket(self._ctx)


class MemClient(_SocketClient):
    """Blocking client. ``with MemClient(addr) as mem: mem.alloc_row("r1")``."""

    def __init__(self, address: str, **options: Any) -> None:
        """``options``: ``role``, ``name``, ``lease_s``, ``timeout_s``, ``retries``,
        ``heartbeat`` and ``curve`` (see :class:`_SocketClient`)."""
        super().__init__(address, **options)
        self._requester = rpc.Requester(self._sock)
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        try:
            self._invoke(self._state.hello_call())
        except BaseException:
            self.close()
            raise
        if self._want_heartbeat:
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, name="memsvc-heartbeat", daemon=True
            )
            self._heartbeat_thread.start()

    def _invoke(self, call: _Call) -> Any:
        return self._roundtrip(self._requester, call)

    def _roundtrip(self, requester: rpc.Requester, call: _Call) -> Any:
        state = self._state
        op_id, frames = state.frames(call)
        try:
            header = requester.request(frames, op_id, state.timeout_s, state.retries)
        except rpc.NoReplyError:
            raise state.dead(call) from None
        return state.finish(call, header)

    def _heartbeat_loop(self) -> None:
        sock = self._state.new_socket(self._ctx)  # sockets are not thread-safe
        requester = rpc.Requester(sock)
        try:
            while not self._stop.wait(self._state.lease_s / 3):
                with contextlib.suppress(errors.MemsvcError):
                    self._roundtrip(requester, _Call("heartbeat", {}, None, _nothing))
        finally:
            sock.close(0)

    def reconnect(self) -> None:
        """Say hello again (after an epoch change): a new session, the new pool's handle."""
        self._state.epoch = None
        self._invoke(self._state.hello_call())

    def close(self, *, goodbye: bool = True) -> None:
        """Stop heartbeats; with ``goodbye``, end the session so memsvc reclaims it at once."""
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
            self._heartbeat_thread = None
        if goodbye and self._state.session is not None and not self._sock.closed:
            with contextlib.suppress(errors.MemsvcError):
                self._state.retries, self._state.timeout_s = 0, min(self._state.timeout_s, 1.0)
                self._invoke(_Call("goodbye", {}, None, _nothing))
        self._state.session = None
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> MemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncMemClient(_SocketClient):
    """asyncio client: ``mem = await AsyncMemClient.connect(addr)``; every op is awaited.

    Its socket is a plain one, waited on through the event loop by an
    :class:`~memsvc.rpc.AsyncRequester` (not a ``zmq.asyncio`` socket, whose
    futures cost more than memsvc's own work on a decode step).
    """

    def __init__(self, address: str, **options: Any) -> None:
        """``options``: as :class:`MemClient`'s."""
        super().__init__(address, **options)
        self._requester = rpc.AsyncRequester(self._sock)
        self._lock = asyncio.Lock()
        self._heartbeat_task: asyncio.Task | None = None

    @classmethod
    async def connect(cls, address: str, **kwargs: Any) -> AsyncMemClient:
        client = cls(address, **kwargs)
        try:
            await client._invoke(client._state.hello_call())
        except BaseException:
            await client.close(goodbye=False)
            raise
        if client._want_heartbeat:
            client._heartbeat_task = asyncio.create_task(
                client._heartbeat_loop(), name="memsvc-heartbeat"
            )
        return client

    async def _invoke(self, call: _Call) -> Any:
        state = self._state
        async with self._lock:  # one request in flight: replies come back in order
            op_id, frames = state.frames(call)
            try:
                header = await self._requester.request(
                    frames, op_id, state.timeout_s, state.retries
                )
            except rpc.NoReplyError:
                raise state.dead(call) from None
            return state.finish(call, header)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._state.lease_s / 3)
            with contextlib.suppress(errors.MemsvcError):
                await self.heartbeat()

    async def reconnect(self) -> None:
        self._state.epoch = None
        await self._invoke(self._state.hello_call())

    async def close(self, *, goodbye: bool = True) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if goodbye and self._state.session is not None:
            with contextlib.suppress(errors.MemsvcError):
                self._state.retries, self._state.timeout_s = 0, min(self._state.timeout_s, 1.0)
                await self._invoke(_Call("goodbye", {}, None, _nothing))
        self._state.session = None
        self._requester.close()
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncMemClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def attach(handle: dict[str, Any]) -> AttachedBuffers:
    """Map a pool from the handle in a ``hello`` reply (zero-copy numpy / torch views)."""
    return attach_handle(handle)
