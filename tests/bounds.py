"""Oversize messages against a service's socket (issue 18, defect 5), as a peer sends them.

Each service bounds a whole message, not only each frame: a message over its
byte limit (every frame under it) or with more frames than any message has
gets ``too_large`` under its op_id, and a frame over the hard cap makes ZMQ
drop the sender before reading it, so the service's memory does not grow by
that frame.
"""

from __future__ import annotations

import zmq

from memsvc import protocol as wire
from memsvc import rpc


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _ask(sock: zmq.Socket, frames: list[bytes]) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "no reply"
    return wire.unpack(sock.recv_multipart())


def assert_messages_bounded(
    address: str,
    header: dict,
    *,
    over_bytes: list[int],
    num_frames: int = 64,
    pid: int | None = None,
    frame_over_cap: int = 0,
) -> None:
    """``header`` followed by frames of ``over_bytes`` (over the limit in total), then by
    ``num_frames`` one-byte frames: each gets ``too_large`` under its op_id. With ``pid``
    and ``frame_over_cap``, one frame that large gets no reply and leaves the peak RSS of
    ``pid`` less than half of it higher."""
    ctx = zmq.Context()
    sock = rpc.dealer(ctx, address)
    try:
        if pid is not None and frame_over_cap:
            before = peak_rss_bytes(pid)
            sock.send_multipart([wire.pack({**header, "op_id": 1})[0], b"\0" * frame_over_cap])
            assert not sock.poll(2000), "a frame over the hard cap was answered"
            grown = peak_rss_bytes(pid) - before
            assert grown < frame_over_cap // 2, f"peak RSS grew by {grown >> 20} MiB"
        cases = [(2, [b"\0" * n for n in over_bytes]), (3, [b"\0"] * num_frames)]
        for op_id, frames in cases:
            reply = _ask(sock, [wire.pack({**header, "op_id": op_id})[0], *frames])
            assert reply["ok"] is False and reply["code"] == "too_large", reply
            assert reply["op_id"] == op_id and "limit" in reply["message"], reply
    finally:
        sock.close(0)
        ctx.term()
