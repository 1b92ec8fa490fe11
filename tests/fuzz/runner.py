"""Send seeded messages to one live socket; count crashes, hangs and inconsistencies.

One message is in flight at a time. Each socket's :class:`Channel` knows which
replies are due (every message on memsvc, scheduler_svc, model_svc and HTTP,
whose generators keep messages small enough to be read; ``query`` / ``done``
on the transfer socket); none within ``reply_timeout_s`` is a hang, after
which the channel is replaced so a late reply cannot be taken for the next
one's. A process of the target that exits is a crash. After every batch the
target runs memsvc's integrity check and compares the legitimate session's
state with its state before the run (an inconsistency each). An error reply
coded ``internal`` (HTTP: 5xx) or without a message is an internal error.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import zmq

from memsvc import protocol as wire
from memsvc import rpc


class Messages(Protocol):
    def next(self, rng: random.Random) -> Any: ...
    def observe(self, header: dict[str, Any]) -> None: ...


class Channel(Protocol):
    """How messages reach the socket: ``send`` returns the reply headers, None on a hang."""

    def send(self, message: Any, timeout_s: float) -> list[dict[str, Any]] | None: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


class Target(Protocol):
    """One socket under fuzz, with the services behind it and a legitimate session."""

    name: str
    messages: Messages

    def channel(self) -> Channel: ...
    def alive(self) -> bool: ...
    def end_batch(self, channel: Channel) -> None: ...
    def problems(self) -> list[str]: ...


class ZmqChannel:
    """A DEALER to ``address``; replies are read up to the one ``is_last`` says ends them."""

    def __init__(self, address: str, is_last=lambda header: True) -> None:
        self.address, self.is_last = address, is_last
        self.ctx = zmq.Context()
        self.sock = rpc.dealer(self.ctx, address)

    def send(self, message: list[bytes], timeout_s: float) -> list[dict[str, Any]] | None:
        self.sock.send_multipart(message)
        deadline = time.monotonic() + timeout_s
        replies = []
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                return None
            try:
                header = wire.unpack(self.sock.recv_multipart())
            except wire.ProtocolError as exc:
                header = {"ok": False, "code": "unreadable_reply", "message": str(exc)}
            replies.append(header)
            if self.is_last(header):
                return replies

    def reset(self) -> None:
        """A new socket: a late reply must not be taken for the next message's."""
        self.sock.close(0)
        self.sock = rpc.dealer(self.ctx, self.address)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@dataclass(slots=True)
class Figures:
    socket: str
    messages: int = 0
    crashes: int = 0
    hangs: int = 0
    inconsistencies: int = 0
    internal_errors: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.crashes or self.hangs or self.inconsistencies or self.internal_errors)

    def as_json(self) -> dict[str, Any]:
        figures = asdict(self)
        figures["findings"] = figures["findings"][:20]
        figures["seconds"] = round(self.seconds, 1)
        return figures


def fuzz(
    target: Target,
    num_messages: int,
    seed: int,
    *,
    batch: int = 100,
    reply_timeout_s: float = 10.0,
) -> Figures:
    """``num_messages`` seeded messages to ``target``, checked every ``batch``."""
    rng = random.Random(seed)
    figures = Figures(target.name)
    started = time.monotonic()
    channel = target.channel()
    try:
        while figures.messages < num_messages:
            for _ in range(min(batch, num_messages - figures.messages)):
                message = target.messages.next(rng)
                figures.messages += 1
                replies = channel.send(message, reply_timeout_s)
                if replies is None:
                    figures.hangs += 1
                    figures.findings.append(f"hang: no reply to {_describe(message)}")
                    channel.reset()
                for header in replies or ():
                    _count(header, message, figures)
                    target.messages.observe(header)
                if not target.alive():
                    figures.crashes += 1
                    figures.findings.append(f"crash after {_describe(message)}")
                    return figures
            target.end_batch(channel)
            problems = target.problems()
            figures.inconsistencies += len(problems)
            figures.findings += problems
            if not target.alive():
                figures.crashes += 1
                return figures
    finally:
        channel.close()
        figures.seconds = time.monotonic() - started
    return figures


def _count(header: dict[str, Any], message: Any, figures: Figures) -> None:
    code = str(header.get("code") or "ok") if header.get("ok") else str(header.get("code"))
    figures.codes[code] = figures.codes.get(code, 0) + 1
    if code == "unreadable_reply":
        figures.inconsistencies += 1
        figures.findings.append(f"unreadable reply to {_describe(message)}")
    elif not header.get("ok") and (code == "internal" or not header.get("message")):
        figures.internal_errors += 1
        figures.findings.append(f"{code}: {header.get('message')!r} for {_describe(message)}")


def _describe(message: Any) -> str:
    if isinstance(message, list):
        message = [frame[:200] for frame in message[:4]]
    return repr(message)[:600]
