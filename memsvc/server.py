"""The service shell of memsvc: a ZMQ ROUTER socket, the lease reaper, signals.

It owns sockets, threads and timers and nothing else: every request goes to
:meth:`MemService.handle`, which runs to completion before the next one is
read. Everything it starts is stopped and joined on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from memsvc.core.errors import InvalidArgumentError
from memsvc.handlers import MemService

log = logging.getLogger("memsvc")

# Messages over the service's own limit but under this multiple of it get a
# `too_large` error reply; ZMQ drops a peer that sends a frame larger still.
HARD_LIMIT_FACTOR = 4


@dataclass(frozen=True)
class CurveServerKeys:
    """CURVE for TCP: the server's certificate and a folder of authorized client certs."""

    secret_key_file: str
    authorized_clients_dir: str


def default_listen_address() -> str:
    """An ``ipc://`` path in a private (0700) runtime folder."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    folder = Path(base) / f"kvstack-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return f"ipc://{folder}/memsvc-{os.getpid()}.sock"


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


class MemServer:
    """Serves one :class:`MemService` until SIGTERM / SIGINT or :meth:`request_stop`.

    The socket loop runs in one dedicated thread, blocking in ``zmq_poll`` the
    way a bare ZMQ server does (an event-loop reader costs this path extra
    syscalls and wake-ups). That thread is the only one that touches the
    service, the lease reaper included, so each op stays atomic. The asyncio
    side owns what is asynchronous: signals, start-up, and shutdown.
    """

    def __init__(
        self,
        service: MemService,
        listen: str,
        *,
        reap_interval_s: float = 0.25,
        curve: CurveServerKeys | None = None,
        ready_file: str | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.service = service
        self.listen = listen
        self.reap_interval_s = reap_interval_s
        self.curve = curve
        self.ready_file = ready_file
        self.metrics_port = metrics_port
        self._ctx = zmq.Context()
        self._stop_address = f"inproc://memsvc-stop-{id(self)}"

    def request_stop(self) -> None:
        """Ask the socket thread to finish (thread-safe)."""
        with contextlib.suppress(zmq.ZMQError):
            stopper = self._ctx.socket(zmq.PAIR)
            stopper.setsockopt(zmq.LINGER, 0)
            stopper.connect(self._stop_address)
            stopper.send(b"stop")
            stopper.close(0.5)

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
            name="memsvc-socket",
        )
        thread.start()
        try:
            error = await started
            if error is not None:
                raise error
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            self._write_ready_file()
            print(f"memsvc listening on {self.listen} (epoch {self.service.epoch})", flush=True)
            error = await finished
            if error is not None:
                raise error
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            self.request_stop()
            await asyncio.to_thread(thread.join)
            self._ctx.term()
            if self.listen.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.listen[len("ipc://") :])
            if self.ready_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.ready_file)
            log.info("memsvc stopped")

    def _serve_thread(self, on_started, on_finished) -> None:
        """Bind, then answer requests and expire leases until told to stop."""
        auth = None
        sock = self._ctx.socket(zmq.ROUTER)
        stop = self._ctx.socket(zmq.PAIR)
        error: BaseException | None = None
        try:
            stop.bind(self._stop_address)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(
                zmq.MAXMSGSIZE, self.service.config.max_message_bytes * HARD_LIMIT_FACTOR
            )
            if self.curve:
                auth = self._start_curve(sock)
            sock.bind(self.listen)
        except BaseException as exc:
            error = exc
        on_started(error)
        try:
            if error is None:
                self._serve(sock, stop)
        except BaseException as exc:  # a bug in the loop: stop the service, say why
            log.exception("memsvc socket thread failed")
            error = exc
        finally:
            sock.close(0)
            stop.close(0)
            if auth is not None:
                auth.stop()
            on_finished(error)

    def _serve(self, sock: zmq.Socket, stop: zmq.Socket) -> None:
        handle = self.service.handle
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        interval_ms = self.reap_interval_s * 1000
        next_reap = time.monotonic() + self.reap_interval_s
        while True:
            ready = dict(poller.poll(interval_ms))
            if stop in ready:
                return
            if sock in ready:
                while True:  # drain: answer everything that is waiting
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) < 2:
                        continue  # no identity + payload: nothing to answer
                    try:
                        sock.send_multipart([frames[0], *handle(frames[1:])], zmq.NOBLOCK)
                    except zmq.Again:
                        log.warning("reply dropped: the client's queue is full")
            now = time.monotonic()
            if now >= next_reap:
                self.service.expire_sessions(now)
                next_reap = now + self.reap_interval_s

    def _start_curve(self, sock: zmq.Socket):
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(self.curve.secret_key_file)
        if secret is None:
            raise InvalidArgumentError(f"{self.curve.secret_key_file} holds no secret key")
        auth = ThreadAuthenticator(self._ctx)
        auth.start()
        auth.configure_curve(domain="*", location=self.curve.authorized_clients_dir)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        return auth

    def _write_ready_file(self) -> None:
        if not self.ready_file:
            return
        info = {
            "address": self.listen,
            "epoch": self.service.epoch,
            "pid": os.getpid(),
            "metrics_port": self.metrics_port,
        }
        tmp = f"{self.ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, self.ready_file)
