"""A ZMQ proxy between a client and a kvstack service that damages traffic on purpose.

:class:`FaultProxy` binds ``front`` (a ROUTER, where clients connect) and
gives every client its own DEALER to ``back`` (the service), so the service
still sees one peer per client and replies route back by identity. Each
message, in either direction, may be delayed, dropped, duplicated, garbled
(its header made undecodable) or truncated (its last frame cut off),
following a :class:`FaultPlan` and a seeded random stream; with no plan it
passes everything through untouched. Content is never changed in a way that
still decodes: a real transport loses, repeats or cuts messages, it does not
rewrite numbers in them (the services have no checksums, so that would be
undetectable by design).

``on_request`` sees every request header on its way to the service (the
fault harness uses it to kill memsvc right when a ``retract`` passes).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

FAULT_KINDS = ("drop", "duplicate", "delay", "garble", "truncate")


@dataclass(frozen=True)
class FaultPlan:
    """Probability of each fault per message; ``directions`` among "request", "reply"."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    garble: float = 0.0
    truncate: float = 0.0
    max_delay_s: float = 0.3
    directions: tuple[str, ...] = ("request", "reply")

    def pick(self, rng: random.Random) -> str | None:
        roll = rng.random()
        for kind in FAULT_KINDS:
            roll -= getattr(self, kind)
            if roll < 0:
                return kind
        return None


def garble(frames: list[bytes]) -> list[bytes]:
    """0xc1 is never valid msgpack: the header cannot be decoded."""
    return [b"\xc1" + frames[0][1:], *frames[1:]]


def truncate(frames: list[bytes]) -> list[bytes]:
    """Cut off the last frame (or half of a lone header)."""
    if len(frames) > 1:
        return frames[:-1]
    return [frames[0][: len(frames[0]) // 2]]


class FaultProxy:
    """``with FaultProxy(front, back, seed=1) as proxy: proxy.plan = FaultPlan(drop=0.1)``."""

    def __init__(
        self,
        front: str,
        back: str,
        *,
        seed: int = 0,
        name: str = "proxy",
        on_request: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.front, self.back, self.name = front, back, name
        self.plan: FaultPlan | None = None
        self.on_request = on_request
        self._counts: Counter[str] = Counter()  # faults injected, by kind
        self._counts_lock = threading.Lock()
        self.forwarded = 0
        self._rng = random.Random(seed)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._error: BaseException | None = None

    @property
    def counts(self) -> Counter[str]:
        """Faults injected so far, by kind (a copy: the proxy thread keeps counting)."""
        with self._counts_lock:
            return Counter(self._counts)

    # -- life ------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}", daemon=True)
        self._thread.start()
        self._bound.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._ctx.term()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop ----------------------------------------------------------------

    def _run(self) -> None:
        front = self._ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        backs: dict[bytes, zmq.Socket] = {}
        try:
            front.bind(self.front)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            front.close(0)
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        owners: dict[zmq.Socket, bytes] = {}
        pending: list[tuple[float, int, Callable[[], None]]] = []  # delayed sends
        order = itertools.count()
        try:
            while not self._stop.is_set():
                timeout = 50
                if pending:
                    timeout = max(0, min(50, int((pending[0][0] - time.monotonic()) * 1000)))
                for sock, _ in poller.poll(timeout):
                    frames = sock.recv_multipart()
                    if sock is front:
                        identity, payload = frames[0], frames[1:]
                        back = backs.get(identity)
                        if back is None:
                            back = backs[identity] = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(self.back)
                            poller.register(back, zmq.POLLIN)
                            owners[back] = identity
                        self._watch(payload)
                        self._route("request", payload, back.send_multipart, pending, order)
                    else:
                        identity = owners[sock]
                        self._route(
                            "reply",
                            frames,
                            lambda f, i=identity: front.send_multipart([i, *f]),
                            pending,
                            order,
                        )
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    heapq.heappop(pending)[2]()
        finally:
            front.close(0)
            for back in backs.values():
                back.close(0)
            if self.front.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.front[len("ipc://") :])

    def _watch(self, payload: list[bytes]) -> None:
        if self.on_request is None or not payload:
            return
        try:
            header = msgpack.unpackb(payload[0], raw=False)
        except Exception:  # a damaged message: nothing to watch
            return
        if isinstance(header, dict):
            self.on_request(header)

    def _route(
        self,
        direction: str,
        frames: list[bytes],
        send: Callable[[list[bytes]], None],
        pending: list,
        order: itertools.count,
    ) -> None:
        self.forwarded += 1
        plan = self.plan
        kind = plan.pick(self._rng) if plan and direction in plan.directions else None
        if kind is not None:
            with self._counts_lock:
                self._counts[kind] += 1
        if kind == "drop":
            return
        if kind == "garble":
            frames = garble(frames)
        elif kind == "truncate":
            frames = truncate(frames)
        elif kind == "delay":
            due = time.monotonic() + self._rng.uniform(0, plan.max_delay_s)
            heapq.heappush(pending, (due, next(order), lambda: send(frames)))
            return
        send(frames)
        if kind == "duplicate":
            send(frames)
