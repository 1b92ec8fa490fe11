"""The asyncio shell of memsvc: a ZMQ ROUTER socket, the lease reaper, signals.

It owns sockets, tasks and timers and nothing else: every request goes to
:meth:`MemService.handle`, which runs to completion before the next one is
read. Every task it starts is kept and cancelled on the way out.
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
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

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
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        auth = None
        sock = ctx.socket(zmq.ROUTER)
        tasks: list[asyncio.Task] = []
        loop = asyncio.get_running_loop()
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(
                zmq.MAXMSGSIZE, self.service.config.max_message_bytes * HARD_LIMIT_FACTOR
            )
            if self.curve:
                auth = self._start_curve(ctx, sock)
            sock.bind(self.listen)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
            tasks = [
                asyncio.create_task(self._serve(sock), name="memsvc-serve"),
                asyncio.create_task(self._reap(), name="memsvc-reaper"),
            ]
            self._write_ready_file()
            print(f"memsvc listening on {self.listen} (epoch {self.service.epoch})", flush=True)
            stop_wait = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            for task in done:
                if task is not stop_wait and task.exception():
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            sock.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()
            if self.listen.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.listen[len("ipc://") :])
            if self.ready_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.ready_file)
            log.info("memsvc stopped")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        handle = self.service.handle
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 2:
                continue  # no identity + payload: nothing to answer
            await sock.send_multipart([frames[0], *handle(frames[1:])])

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.reap_interval_s)
            self.service.expire_sessions()

    def _start_curve(self, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket):
        import zmq.auth
        from zmq.auth.asyncio import AsyncioAuthenticator

        public, secret = zmq.auth.load_certificate(self.curve.secret_key_file)
        if secret is None:
            raise InvalidArgumentError(f"{self.curve.secret_key_file} holds no secret key")
        auth = AsyncioAuthenticator(ctx)
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
