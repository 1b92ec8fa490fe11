"""A stand-in for the part of cupy the cuda backend uses, with host memory as "device" memory.

It lets the CPU run the cuda backend's own code: its page-run pointer
arithmetic, its copy kinds, its events and fences. Copies issued with
``memcpyAsync`` really are deferred: they wait in their stream's queue until
the stream (or an event recorded on it, or the device) is synchronized, as
on a GPU where the copy engine runs behind the host. So a page reused before
its copy has run is caught: the copy then reads the new owner's bytes.

Not simulated: CUDA IPC between processes, NIXL, the real driver's errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from collections import deque
from typing import Any

import numpy as np


class CUDARuntimeError(RuntimeError):
    pass


class OutOfMemoryError(MemoryError):
    pass


class Stream:
    """A queue of copies, run in order when synchronized."""

    _next_ptr = 1

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = Stream._next_ptr
        Stream._next_ptr += 1
        self.pending: deque[tuple[int, int, int]] = deque()
        self.issued = 0  # copies ever queued
        self.ran = 0  # copies run
        STREAMS[self.ptr] = self

    def run_until(self, count: int) -> None:
        while self.ran < count and self.pending:
            dst, src, nbytes = self.pending.popleft()
            ctypes.memmove(dst, src, nbytes)
            self.ran += 1

    def synchronize(self) -> None:
        self.run_until(self.issued)


STREAMS: dict[int, Stream] = {}


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self._stream: Stream | None = None
        self._mark = 0

    def record(self, stream: Stream) -> None:
        self._stream, self._mark = stream, stream.issued

    @property
    def done(self) -> bool:
        return self._stream is None or self._stream.ran >= self._mark

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_until(self._mark)


class Memory:
    """A "device" allocation: host bytes that only the backend's copies should touch."""

    def __init__(self, size: int) -> None:
        if size > FREE_BYTES["value"]:
            raise OutOfMemoryError(f"out of memory allocating {size} bytes")
        self.buffer = np.zeros(max(size, 1), dtype=np.uint8)
        self.ptr = self.buffer.ctypes.data
        self.size = size


class MemoryPointer:
    def __init__(self, memory: Memory, offset: int) -> None:
        self.mem, self.offset = memory, offset
        self.ptr = memory.ptr + offset


class DeviceArray(np.ndarray):
    """numpy with cupy's ``set`` (and indexing that stays in "device" memory)."""

    def set(self, values: np.ndarray, stream: Stream | None = None) -> None:
        self[...] = values


def ndarray(shape: tuple[int, ...], dtype: Any, memptr: MemoryPointer) -> DeviceArray:
    count = int(np.prod(shape))
    flat = np.frombuffer(memptr.mem.buffer, dtype=dtype, count=count, offset=memptr.offset)
    return flat.reshape(shape).view(DeviceArray)


def device_synchronize() -> None:
    for stream in STREAMS.values():
        stream.synchronize()


FREE_BYTES = {"value": 1 << 40}


def make(devices: int = 1, free_bytes: int = 1 << 40) -> types.SimpleNamespace:
    """A fresh stand-in module (``sys.modules["cupy"]`` for the test's duration)."""
    STREAMS.clear()
    FREE_BYTES["value"] = free_bytes

    def ipc_open(handle: bytes) -> int:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: devices,
        CUDARuntimeError=CUDARuntimeError,
        ipcGetMemHandle=lambda ptr: ptr.to_bytes(64, "little"),
        ipcOpenMemHandle=ipc_open,
        deviceSynchronize=device_synchronize,
        memcpyAsync=lambda dst, src, n, kind, stream: (
            STREAMS[stream].pending.append((dst, src, n)) or _count(STREAMS[stream])
        ),
        memcpyDeviceToHost=2,
        memcpyHostToDevice=1,
    )
    cuda = types.SimpleNamespace(
        runtime=runtime,
        Device=lambda index: contextlib.nullcontext(),
        Memory=Memory,
        MemoryPointer=MemoryPointer,
        Stream=Stream,
        Event=Event,
        alloc_pinned_memory=lambda nbytes: bytearray(nbytes),
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    )
    return types.SimpleNamespace(
        cuda=cuda,
        ndarray=ndarray,
        asarray=lambda a, dtype=None: np.asarray(a, dtype=dtype),
        asnumpy=lambda a: np.array(a),
    )


def _count(stream: Stream) -> None:
    stream.issued += 1
