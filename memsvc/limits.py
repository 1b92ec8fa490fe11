"""What one message may make a service hold: its bytes, its frames, and one frame.

Every socket of the stack that peers write to reads through :func:`recv_bounded`
(or :func:`recv_bounded_async`). It counts a multipart message's frames and
bytes as it reads them and keeps none past :class:`MessageLimit`'s
``max_bytes`` / ``max_frames``: the rest is read and dropped a frame at a time,
and the caller gets the first ``keep`` frames (the routing identity and the
header, to answer under the op_id) with the ``too_large`` error to send.
ZMQ_MAXMSGSIZE (:meth:`MessageLimit.apply`) caps one frame at
``max_frame_bytes``: libzmq drops a peer that announces a larger frame before
it reads the frame.

What no socket option bounds: libzmq hands a multipart message over only once
its last frame has arrived, and holds every frame until then (libzmq 4.3.5: a
peer sending 400 frames of 512 KiB and no last one grew the receiver by 200
MiB, and the socket never became readable). Keeping such peers off a socket
is CURVE's job (:mod:`memsvc.curve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import zmq
import zmq.asyncio

from memsvc.core.errors import InvalidArgumentError
from memsvc.protocol import ProtocolError, best_effort_op_id, pack

# A frame over the service's own limit but under this multiple of it still gets a
# `too_large` reply (the service reads it); ZMQ drops a peer sending one larger still.
HARD_LIMIT_FACTOR = 4
DEFAULT_MAX_BYTES = 64 << 20
# Frames in one message, a ROUTER's routing identity included: a header, the
# arrays of the largest op (model_svc's extend has four), and room to spare.
DEFAULT_MAX_FRAMES = 16


@dataclass(frozen=True, slots=True)
class MessageLimit:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_frames: int = DEFAULT_MAX_FRAMES
    hard_factor: int = HARD_LIMIT_FACTOR

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_frames < 2 or self.hard_factor < 1:
            raise InvalidArgumentError(f"{self} allows no message")

    @property
    def max_frame_bytes(self) -> int:
        return self.max_bytes * self.hard_factor

    def apply(self, sock: zmq.Socket) -> None:
        """The hard per-frame cap, on a socket before it binds or connects."""
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)

    def error(self, num_frames: int, num_bytes: int) -> ProtocolError:
        return ProtocolError(
            "too_large",
            f"message of {num_frames} frames and {num_bytes} bytes exceeds the limit of "
            f"{self.max_frames} frames and {self.max_bytes} bytes",
        )


DEFAULT_LIMIT = MessageLimit()


class Inbound(NamedTuple):
    """One message as read: all of it, or only its first ``keep`` frames and why."""

    frames: list
    too_large: ProtocolError | None = None


def _done(frames: list, num_frames: int, num_bytes: int, limit: MessageLimit, keep: int) -> Inbound:
    if num_frames <= limit.max_frames and num_bytes <= limit.max_bytes:
        return Inbound(frames)
    return Inbound(frames[:keep], limit.error(num_frames, num_bytes))


def recv_bounded(
    sock: zmq.Socket, limit: MessageLimit, *, keep: int, flags: int = 0, copy: bool = True
) -> Inbound:
    """One message from ``sock``, holding at most ``limit`` of it (raises ``zmq.Again``
    with ``zmq.NOBLOCK`` when there is none). ``copy=False`` gives ``zmq.Frame``s.

    The loop of pyzmq's ``recv_multipart``, counting (on memsvc's hot path: no
    object but the list and the result).
    """
    frame = sock.recv(flags, copy=copy)
    frames, num_frames, num_bytes = [frame], 1, len(frame)
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(0, copy=copy)  # the rest is here: libzmq delivers messages whole
        num_frames += 1
        num_bytes += len(frame)
        # Past the limit only the first `keep` frames stay; the rest is dropped here.
        if len(frames) < keep or (num_frames <= limit.max_frames and num_bytes <= limit.max_bytes):
            frames.append(frame)
    return _done(frames, num_frames, num_bytes, limit, keep)


async def recv_bounded_async(
    sock: zmq.asyncio.Socket, limit: MessageLimit, *, keep: int
) -> Inbound:
    """:func:`recv_bounded` for an asyncio socket (which must have one reader)."""
    frame = await sock.recv()
    frames, num_frames, num_bytes = [frame], 1, len(frame)
    while sock.getsockopt(zmq.RCVMORE):
        frame = await sock.recv()
        num_frames += 1
        num_bytes += len(frame)
        if len(frames) < keep or (num_frames <= limit.max_frames and num_bytes <= limit.max_bytes):
            frames.append(frame)
    return _done(frames, num_frames, num_bytes, limit, keep)


def too_large_reply(frames: list[bytes], error: ProtocolError) -> list[bytes]:
    """The error reply to a message over the limit, under its op_id if its header has one."""
    header = {"ok": False, "op_id": best_effort_op_id(frames), "code": error.code}
    return pack({**header, "message": error.message})
