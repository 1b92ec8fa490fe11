"""``kvstack serve``'s serve loop: the front on its listening socket until SIGINT /
SIGTERM, and the signals noted (not acted on) while the stack starts or stops."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from kvstack.serve.app import HttpFront
from kvstack.serve.backends import ServeError
from kvstack.serve.limits import listen_backlog
from memsvc.cli import write_ready_file

log = logging.getLogger("kvstack.http")

SHUTDOWN_GRACE_S = 5.0  # in-flight requests get this long, then are cancelled (and aborted)


async def serve(
    front: HttpFront, args: argparse.Namespace, signals: DeferredSignals | None = None
) -> None:
    """Serve until SIGINT / SIGTERM; in-flight requests get a short grace, then are aborted."""
    runner = web.AppRunner(
        front.app(),
        shutdown_timeout=SHUTDOWN_GRACE_S,
        handler_cancellation=True,
        **front.limits.aiohttp_settings(),
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if signals is not None and signals.received is not None:
        stop.set()  # it came before the handlers above
    listener: asyncio.Server | None = None
    try:
        # The listening socket is ours, not an aiohttp site, so that every connection
        # goes through the front's connection cap first.
        assert runner.server is not None
        factory = front.connections.protocol_factory(runner.server)
        try:
            listener = await loop.create_server(
                factory, args.host, args.port, backlog=listen_backlog()
            )
        except OSError as exc:
            raise ServeError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
        host, port = listener.sockets[0].getsockname()[:2]
        address = f"http://{host}:{port}"
        write_ready_file(
            args.ready_file,
            address,
            scheduler=front.backend.scheduler,
            services=front.backend.pids,
            metrics=front.backend.metrics,
        )
        print(f"kvstack serve: listening on {address} (scheduler {front.backend.scheduler})")
        sys.stdout.flush()
        await stop.wait()
        log.info("stopping")
    finally:
        if listener is not None:
            listener.close()  # no new connections; runner.cleanup() ends the open ones
        await runner.cleanup()
        if args.ready_file:
            with contextlib.suppress(FileNotFoundError):
                Path(args.ready_file).unlink()


class DeferredSignals:
    """SIGINT / SIGTERM noted instead of acted on, while the stack starts or stops.

    A signal that killed this process there would orphan the services it has
    started (or is starting, which the launcher does not yet know about).
    """

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.received = signum
