"""The PD transfer socket (a decode-role memsvc's listener), fuzzed as a hostile prefill peer.

Only ``query`` and ``done`` are answered (the protocol's other kinds are
one-way), so a reply is due for a well-formed ``query`` and for a ``done``
that is not for the fuzzer's own open room (that one may be dropped as
malformed); other messages are sent and whatever comes back is drained. The
fuzzer's session opens rooms on its own request; the legitimate session's
request (a written pattern, in no room) must keep its bytes, and memsvc's
check must pass after every batch.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import msgpack
import numpy as np
import zmq

from kvstack.stack.launch import Launcher
from memsvc.client import MemClient
from memsvc.core.errors import MemsvcError
from memsvc.movers import pack_frames
from tests.fuzz.mutate import EDGE_INTS, garbage, hostile_value, mutate_frames
from tests.fuzz.targets import free_and_close, memsvc_check_failed
from tests.procs import SMALL_POOL

KINDS = ("hello", "query", "data", "done", "abort", "nope")
FUZZ_TOKENS = 8  # two pages


class TransferMessages:
    def __init__(self, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.room = 0  # the fuzzer's open room (set by the target each batch)

    def observe(self, header: dict[str, Any]) -> None:
        pass

    def next(self, rng: random.Random) -> list[bytes]:
        roll = rng.random()
        if roll < 0.08:
            return garbage(rng)
        kind = rng.choice(KINDS)
        header: dict[str, Any] = {
            "t": kind,
            "room": rng.choice([self.room] * 4 + [self.room + 1, 7]),
        }
        header["rid"] = rng.choice(["fz"] * 6 + ["legit", "x"])
        payload = None
        if kind == "data":
            header["start"] = rng.choice([0, 1, 0, -1, 2, 2**40])
            num_pages = rng.choice([1, 1, 2, 3])
            payload = rng.randbytes(8) * (self.page_bytes * num_pages // 8)
            if rng.random() < 0.2:
                payload = payload[: rng.randrange(len(payload))]
        elif kind == "done":
            header.update(num_tokens=rng.choice([FUZZ_TOKENS, FUZZ_TOKENS, 1, -1]))
            header.update(first_token=rng.randrange(300), cached_tokens=0)
        elif kind == "abort":
            header["why"] = "fuzz"
        if roll > 0.6:
            key = rng.choice([*header, "extra"])
            header[key] = hostile_value(rng) if rng.random() < 0.7 else rng.choice(EDGE_INTS)
        try:
            frames = pack_frames(header, payload)
        except (TypeError, ValueError, OverflowError):
            return garbage(rng)
        return mutate_frames(frames, rng) if rng.random() < 0.15 else frames

    def reply_due(self, frames: list[bytes]) -> bool:
        try:
            header = msgpack.unpackb(frames[0], raw=False)
        except Exception:  # garbage: dropped, no reply
            return False
        if not isinstance(header, dict) or header.get("t") not in ("query", "done"):
            return False
        room = header.get("room")
        try:
            hash(room)
        except TypeError:
            return False
        if header["t"] == "done":  # the fuzzer's own room may fail to parse its fields
            return room != self.room
        return True


class TransferChannel:
    def __init__(self, address: str, messages: TransferMessages) -> None:
        self.address, self.messages = address, messages
        self.ctx = zmq.Context()
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    def send(self, message: list[bytes], timeout_s: float) -> list[dict[str, Any]] | None:
        self.sock.send_multipart(message)
        replies = []
        if self.messages.reply_due(message):
            if not self.sock.poll(int(timeout_s * 1000)):
                return None
            replies.append(self._read())
        while self.sock.poll(0):
            replies.append(self._read())
        return replies

    def _read(self) -> dict[str, Any]:
        frames = self.sock.recv_multipart()
        try:
            header = msgpack.unpackb(frames[0], raw=False)
        except Exception:
            return {"ok": False, "code": "unreadable_reply", "message": repr(frames[:1])}
        kind = str(header.get("t")) if isinstance(header, dict) else "unreadable_reply"
        return {"ok": kind != "unreadable_reply", "code": kind, "message": kind}

    def reset(self) -> None:
        self.sock.close(0)
        self.sock = self._connect()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class TransferTarget:
    name = "transfer"

    def __init__(self, launcher: Launcher) -> None:
        listen = f"ipc://{launcher.workdir}/transfer-fuzz.sock"
        self.memsvc = launcher.start(
            "memsvc", *SMALL_POOL, "--pd-role", "decode", "--transfer-backend", "zmq",
            "--transfer-listen", listen, name="memsvc-decode-fuzz",
        )  # fmt: skip
        self.address = listen
        self.legit = MemClient(self.memsvc.address, lease_s=60)
        self.legit.alloc_row("legit")
        slots = self.legit.alloc_extend([("legit", 12)]).slots
        self.buffers = self.legit.attach()
        self.pages = np.unique(slots // self.legit.layout.page_size)
        view = self.buffers.kv[self.pages]
        self.buffers.kv[self.pages] = (np.arange(view.size) % 89 + 1).reshape(view.shape)
        self.before = self.buffers.kv[self.pages].tobytes()
        self.fuzzer = MemClient(self.memsvc.address, lease_s=60)
        page_bytes = self.buffers.kv[0].nbytes
        self.messages = TransferMessages(page_bytes)
        self.num_batches = 0
        self._open_room()

    def _open_room(self) -> None:
        """A fresh request and room for the fuzzer (the last one's pages are freed)."""
        with contextlib.suppress(MemsvcError):
            self.fuzzer.pd_forget([self.messages.room])
            self.fuzzer.free_row("fz")
        self.num_batches += 1
        self.fuzzer.alloc_row("fz")
        self.fuzzer.alloc_extend([("fz", FUZZ_TOKENS)])
        self.messages.room = 100 * self.num_batches
        self.fuzzer.pd_expect("fz", self.messages.room)

    def channel(self) -> TransferChannel:
        return TransferChannel(self.address, self.messages)

    def alive(self) -> bool:
        return self.memsvc.proc.poll() is None

    def end_batch(self, channel: TransferChannel) -> None:
        self._open_room()

    def problems(self) -> list[str]:
        found = []
        if self.buffers.kv[self.pages].tobytes() != self.before:
            found.append("the legitimate request's KV bytes changed")
        return found + memsvc_check_failed(self.legit)

    def close(self) -> None:
        self.buffers.close()
        free_and_close([(self.fuzzer, "fz"), (self.legit, "legit")])
