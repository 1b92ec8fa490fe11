"""A bare pyzmq echo: the transport floor that memsvc's round trips are measured against.

A separate process runs a tight sync ROUTER loop that answers each request with
a reply of given frames (keyed by the size of the request's last frame), and a
raw DEALER times the round trip: two processes, one ipc socket, the same bytes
as the real service's. Used by ``memsvc_ops.py`` and ``control_plane_steps.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event
from pathlib import Path

import zmq

STOP_TIMEOUT_S = 10.0


def serve_echo(address: str, replies: dict[int, list[bytes]], ready: Event) -> None:
    """The echo server: answer each request with the reply keyed by its last frame's size."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    ready.set()
    while True:  # ends with SIGTERM
        frames = sock.recv_multipart()
        sock.send_multipart([frames[0], *replies[len(frames[-1])]])


@contextlib.contextmanager
def running_echo(workdir: Path, replies: dict[int, list[bytes]]) -> Iterator[str]:
    address = f"ipc://{workdir}/echo.sock"
    mp = multiprocessing.get_context("spawn")
    ready = mp.Event()
    proc = mp.Process(target=serve_echo, args=(address, replies, ready), name="echo", daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the echo server did not start")
        yield address
    finally:
        proc.terminate()
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


@contextlib.contextmanager
def echo_roundtrip(address: str, request: list[bytes]) -> Iterator[Callable[[], None]]:
    """A raw DEALER round trip of ``request`` to the echo server."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)

    def roundtrip() -> None:
        sock.send_multipart(request)
        sock.recv_multipart()

    try:
        yield roundtrip
    finally:
        sock.close(0)
        ctx.term()
