"""The service shell of memsvc (and model_svc): a ZMQ ROUTER socket, a timer, signals.

It owns sockets, threads and timers and nothing else: every request goes to
:meth:`MemService.handle`, which runs to completion before the next one is
read. Everything it starts is stopped and joined on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol

import zmq

from memsvc import curve
from memsvc.cli import write_ready_file
from memsvc.core.backends.shm import install_sigterm_cleanup
from memsvc.core.errors import InvalidArgumentError
from memsvc.curve import CurveServerKeys
from memsvc.limits import DEFAULT_LIMIT, Inbound, MessageLimit, recv_bounded, too_large_reply
from memsvc.protocol import ProtocolError

log = logging.getLogger("memsvc")


def default_listen_address(name: str = "memsvc") -> str:
    """An ``ipc://`` path in a private (0700) runtime folder."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    folder = Path(base) / f"kvstack-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return f"ipc://{folder}/{name}-{os.getpid()}.sock"


def check_listen_address(address: str, *, allow_remote: bool) -> None:
    """Refuse to bind anything but loopback or ipc unless ``allow_remote``."""
    if address.startswith("ipc://"):
        return
    if not address.startswith("tcp://"):
        raise InvalidArgumentError(f"--listen must be ipc://PATH or tcp://HOST:PORT, got {address}")
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # '*', an interface name, a host name
    if not loopback and not allow_remote:
        raise InvalidArgumentError(
            f"refusing to listen on non-loopback {address}; pass --allow-remote "
            "(and use --curve-secret-key) to serve other hosts"
        )


def metrics_host(args) -> str:
    """``--metrics-host``, refused unless loopback or ``--allow-remote`` (as for --listen)."""
    host = args.metrics_host
    check_listen_address(f"tcp://{host}:0", allow_remote=args.allow_remote)
    return host


async def serve_tasks(
    coros: list[Coroutine[Any, Any, Any]],
    stop: asyncio.Event,
    announce: Callable[[], None],
    on_signal: Callable[[], None] | None = None,
) -> None:
    """Run ``coros`` as tasks until ``stop`` is set (SIGTERM / SIGINT set it, or call
    ``on_signal`` instead when given) or one of them fails.

    ``announce`` runs once they are started (the ready file, the address on
    stdout). However it ends, every task is cancelled and awaited (then the
    signals are as :func:`stop_on_signals` leaves them); a task's exception is raised.
    """
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []
    with stop_on_signals(loop, on_signal or stop.set):
        try:
            tasks = [asyncio.create_task(coro) for coro in coros]
            announce()
            waiter = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for task in done:
                if task is not waiter and task.exception():
                    raise task.exception()
        finally:
            for coro in coros[len(tasks) :]:
                coro.close()  # never started
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


@contextlib.contextmanager
def stop_on_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> Iterator[None]:
    """Inside: SIGINT and SIGTERM call ``stop`` in ``loop``. After: SIGINT raises
    KeyboardInterrupt and SIGTERM SystemExit, so a service's cleanup still runs.

    SIGTERM never goes back to its default action, which would kill the service
    where it stands, with memsvc's shared memory still linked: another SIGTERM
    may well come while it stops (a parent-death signal may come several times,
    as the child passes to each exiting thread of its parent in turn, perhaps
    after the parent's own SIGTERM). So its handler is swapped, never removed
    (removing a loop's handler resets the default); the loop's SIGINT handler
    has it write to the loop's wake-up pipe, so it wakes the loop from any thread.
    """
    loop.add_signal_handler(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, lambda signum, frame: loop.call_soon_threadsafe(stop))
    try:
        yield
    finally:
        install_sigterm_cleanup()
        loop.remove_signal_handler(signal.SIGINT)


def remove_endpoint(listen: str, ready_file: str | None) -> None:
    """Unlink an ``ipc://`` socket path and a ready file left by a stopped service."""
    if listen.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen[len("ipc://") :])
    if ready_file:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready_file)


class Extension(Protocol):
    """More sockets served on the socket thread (memsvc's PD transfer agent)."""

    def open(self, ctx: zmq.Context) -> list[zmq.Socket]: ...

    def on_readable(self, sock: zmq.Socket) -> None: ...

    def progress(self, now: float) -> float:
        """Do what is due; seconds until it next wants to run."""
        ...

    def close(self) -> None: ...


class ServiceShell:
    """Serves a request handler on a ROUTER socket until SIGTERM / SIGINT or :meth:`request_stop`.

    ``handle(frames) -> frames`` answers one request; a message over ``limit``
    is never held whole (see :mod:`memsvc.limits`): ``reject(frames, error)``
    answers it from its header. ``tick(now)`` runs every ``tick_interval_s``
    (memsvc's lease reaper). The socket loop runs in one dedicated thread,
    blocking in ``zmq_poll`` the way a bare ZMQ server does
    (an event-loop reader costs this path extra syscalls and wake-ups). That
    thread is the only one that calls ``handle`` and ``tick``, so each op stays
    atomic. The asyncio side owns what is asynchronous: signals, start-up and
    shutdown.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[list[bytes]], list[bytes]],
        listen: str,
        *,
        tick: Callable[[float], object] | None = None,
        tick_interval_s: float = 0.25,
        limit: MessageLimit = DEFAULT_LIMIT,
        reject: Callable[[list[bytes], ProtocolError], list[bytes]] = too_large_reply,
        curve: CurveServerKeys | None = None,
        ready_file: str | None = None,
        ready_info: dict | None = None,
        extension: Extension | None = None,
    ) -> None:
        self.name = name
        self.extension = extension
        self.handle = handle
        self.listen = listen
        self.tick = tick
        self.tick_interval_s = tick_interval_s
        self.limit, self.reject = limit, reject
        self.curve = curve
        self.ready_file = ready_file
        self.ready_info = ready_info or {}
        self._ctx = zmq.Context()
        self._stopping = threading.Event()

    def request_stop(self) -> None:
        """Ask the socket thread to finish (thread-safe; it notices within one tick)."""
        self._stopping.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        started: asyncio.Future = loop.create_future()
        finished: asyncio.Future = loop.create_future()

        def report(future: asyncio.Future, error: BaseException | None) -> None:
            if not future.done():
                future.set_result(error)

        thread = threading.Thread(
            target=self._serve_thread,
            args=(
                lambda e: loop.call_soon_threadsafe(report, started, e),
                lambda e: loop.call_soon_threadsafe(report, finished, e),
            ),
            name=f"{self.name}-socket",
        )
        thread.start()
        with stop_on_signals(loop, self.request_stop):
            try:
                error = await started
                if error is not None:
                    raise error
                write_ready_file(self.ready_file, self.listen, **self.ready_info)
                epoch = self.ready_info.get("epoch")
                print(f"{self.name} listening on {self.listen} (epoch {epoch})", flush=True)
                error = await finished
                if error is not None:
                    raise error
            finally:
                self.request_stop()
                await asyncio.to_thread(thread.join)
                self._ctx.term()
                remove_endpoint(self.listen, self.ready_file)
                log.info("%s stopped", self.name)

    def _serve_thread(self, on_started, on_finished) -> None:
        """Bind, then answer requests and expire leases until told to stop."""
        auth = None
        sock = self._ctx.socket(zmq.ROUTER)
        error: BaseException | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            self.limit.apply(sock)
            # The context's ZAP handler also vets the extension's CURVE sockets.
            auth = curve.secure_server(self._ctx, sock, self.curve)
            sock.bind(self.listen)
            extra = self.extension.open(self._ctx) if self.extension else []
        except BaseException as exc:
            error = exc
        on_started(error)
        try:
            if error is None and self.extension is not None:
                self._serve_with(sock, extra)
            elif error is None:
                self._serve(sock)
        except BaseException as exc:  # a bug in the loop: stop the service, say why
            log.exception("%s socket thread failed", self.name)
            error = exc
        finally:
            if self.extension is not None:
                self.extension.close()
            sock.close(0)
            if auth is not None:
                auth.stop()
            on_finished(error)

    def _serve(self, sock: zmq.Socket) -> None:
        # The hot path is the one a bare ZMQ server has: a blocking recv, the
        # handler, a send. The receive timeout is the tick, which also bounds
        # how long a stop request waits.
        tick, limit = self.tick, self.limit
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(self.tick_interval_s * 1000)))
        next_tick = time.monotonic() + self.tick_interval_s
        while not self._stopping.is_set():
            try:
                inbound = recv_bounded(sock, limit, keep=2)
            except zmq.Again:
                inbound = None  # the tick's receive timeout
            if inbound is not None:
                self._answer(sock, inbound)
            if tick is not None:
                now = time.monotonic()
                if now >= next_tick:
                    tick(now)
                    next_tick = now + self.tick_interval_s

    def _answer(self, sock: zmq.Socket, inbound: Inbound) -> None:
        """Reply to one message (a routing identity and a payload; anything less is dropped)."""
        frames = inbound.frames
        if len(frames) < 2:
            return
        if inbound.too_large is None:
            reply = self.handle(frames[1:])
        else:
            reply = self.reject(frames[1:], inbound.too_large)
        try:
            sock.send_multipart([frames[0], *reply], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("reply dropped: the client's queue is full")

    def _serve_with(self, sock: zmq.Socket, extra: list[zmq.Socket]) -> None:
        """The loop with an extension: poll every socket, give the extension its turns."""
        tick, extension, limit = self.tick, self.extension, self.limit
        poller = zmq.Poller()
        for s in (sock, *extra):
            poller.register(s, zmq.POLLIN)
        next_tick = time.monotonic() + self.tick_interval_s
        wake = 0.0
        while not self._stopping.is_set():
            timeout = min(wake, self.tick_interval_s)
            for ready, _ in poller.poll(max(0, int(timeout * 1000))):
                if ready is not sock:
                    extension.on_readable(ready)
                    continue
                while True:
                    try:
                        inbound = recv_bounded(sock, limit, keep=2, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(sock, inbound)
            now = time.monotonic()
            wake = extension.progress(now)
            if tick is not None and now >= next_tick:
                tick(now)
                next_tick = now + self.tick_interval_s
