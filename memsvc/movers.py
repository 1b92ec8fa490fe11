"""How KV pages move from memsvc-P's pool to memsvc-D's, once the room is agreed.

Two movers with one interface (``describe`` for the decode side's ready
message, ``start`` a room's pages, ``poll`` until done, ``close``):
:class:`NixlMover` (memsvc-P WRITEs straight into memsvc-D's registered pool)
and :class:`ZmqMover` (the pages as raw bytes frames on the peer socket).
The rooms and the protocol around them are :mod:`memsvc.transfer`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from memsvc.core.errors import InvalidArgumentError
from memsvc.core.pool import KVPool

if TYPE_CHECKING:
    from memsvc.transfer_rooms import Room

log = logging.getLogger("memsvc.transfer")

CHUNK_PAGES = 64  # pages per zmq data frame
# UCX listens on TCP on every network device it may use, whatever address kvstack
# binds; this confines it to the loopback device unless memsvc has --allow-remote.
UCX_DEVICES_ENV, UCX_LOOPBACK = "UCX_NET_DEVICES", "lo"


def confine_ucx_to_loopback() -> None:
    """Make UCX (read when NIXL creates its UCX backend) use the loopback device only.

    Shared-memory and CUDA transports are not network devices: pages still move
    GPU to GPU or through shared memory between memsvc on one host.
    """
    given = os.environ.get(UCX_DEVICES_ENV)
    if given not in (None, "", UCX_LOOPBACK):
        log.warning(
            "%s=%s replaced by %s: UCX may use other network devices only with --allow-remote",
            UCX_DEVICES_ENV,
            given,
            UCX_LOOPBACK,
        )
    os.environ[UCX_DEVICES_ENV] = UCX_LOOPBACK


def pack_frames(header: dict[str, Any], payload: bytes | memoryview | None = None) -> list:
    """A msgpack header frame, and the payload frame (raw bytes) if there is one."""
    frames: list = [msgpack.packb(header, use_bin_type=True)]
    if payload is not None:
        frames.append(payload)
    return frames


NIXL_PROGRESS_S = 0.001  # UCX progress while pages are awaited (no progress thread)


class NixlMover:
    """Pages moved by NIXL (UCX): memsvc-P WRITEs straight into memsvc-D's pool.

    A shm pool is registered as DRAM; a cuda pool (cupy) as VRAM on its
    device, so pages go GPU to GPU (UCX's CUDA transports, NVLink or RDMA
    where present) without staging through host memory.
    """

    name = "nixl"

    def __init__(self, pool: KVPool, agent_name: str, *, allow_remote: bool = False) -> None:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise InvalidArgumentError(
                "--transfer-backend nixl needs the nixl-cu12 wheel "
                "(pip install 'kvstack[nixl]'), or use --transfer-backend zmq"
            ) from exc
        if not allow_remote:
            confine_ucx_to_loopback()
        # No progress thread: NIXL's spins with no pause (the Python API sets its delay
        # to 0), a core per memsvc even when idle. UCX progresses when this side polls
        # a transfer (:meth:`poll`, the sender) or asks for notifications
        # (:meth:`progress`, the receiver, while it waits for pages).
        self.agent = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        kv = pool.buffers.kv
        if isinstance(kv, np.ndarray):
            self.base, self.mem, self.device = int(kv.ctypes.data), "DRAM", 0
        else:  # a cupy array on the GPU
            self.base, self.mem = int(kv.data.ptr), "VRAM"
            self.device = int(pool.buffers.device)
        self.page_bytes = pool.buffers.layout.bytes_per_page
        regions = [(self.base, kv.nbytes, self.device, "")] if kv.nbytes else []
        # a hybrid model's SWA pool too (shm only: the cuda backend refuses hybrid layouts)
        swa_kv = pool.buffers.swa_kv
        self.swa_base, self.swa_page_bytes = 0, pool.buffers.layout.swa_bytes_per_page
        if swa_kv is not None:
            self.swa_base = int(swa_kv.ctypes.data)
            regions.append((self.swa_base, swa_kv.nbytes, self.device, ""))
        self._registered = self.agent.register_memory(regions, self.mem)
        self._remotes: dict[str, str] = {}
        # Rooms whose transfer handle is live (each handle holds the agent too).
        self._in_flight: dict[int, Room] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "agent": self.agent.name,
            "meta": self.agent.get_agent_metadata(),
            "base": self.base,
            "mem": self.mem,
            "device": self.device,
            "swa_base": self.swa_base,
        }

    def _descs(
        self, base: int, pages: np.ndarray, device: int, page_bytes: int | None = None
    ) -> np.ndarray:
        page_bytes = self.page_bytes if page_bytes is None else page_bytes
        if not page_bytes:  # a pure sliding-window model's full pool: no bytes
            return np.zeros((0, 3), dtype=np.uint64)
        descs = np.zeros((pages.size, 3), dtype=np.uint64)
        descs[:, 0] = base + pages.astype(np.uint64) * page_bytes
        descs[:, 1] = page_bytes
        descs[:, 2] = device
        return descs

    def start(
        self,
        room: Room,
        dest: dict[str, Any],
        dst_pages: np.ndarray,
        peer,
        dst_swa_pages: np.ndarray | None = None,
    ) -> None:
        """WRITE the room's full pages and (hybrid) its window's SWA pages, one transfer."""
        name = dest["agent"]
        if name not in self._remotes:
            self._remotes[name] = self.agent.add_remote_agent(dest["meta"])
        device = int(dest.get("device", 0))
        local_descs = self._descs(self.base, room.pages, self.device)
        remote_descs = self._descs(int(dest["base"]), dst_pages, device)
        if room.swa_pages is not None and dst_swa_pages is not None:
            swa = self.swa_page_bytes
            local_descs = np.concatenate(
                [local_descs, self._descs(self.swa_base, room.swa_pages, self.device, swa)]
            )
            remote_descs = np.concatenate(
                [remote_descs, self._descs(int(dest["swa_base"]), dst_swa_pages, device, swa)]
            )
        local = self.agent.get_xfer_descs(local_descs, self.mem)
        remote = self.agent.get_xfer_descs(remote_descs, dest.get("mem", "DRAM"))
        room.handle = self.agent.initialize_xfer("WRITE", local, remote, self._remotes[name])
        self._in_flight[room.room] = room
        if self.agent.transfer(room.handle) == "ERR":
            self._release(room)
            raise RuntimeError("NIXL refused to post the transfer")

    def progress(self) -> float:
        """Let UCX advance what peers do to this side's memory (connection set-up, the
        writes of a transport that needs the target's help, such as TCP); returns the
        seconds until it wants to run again while pages are awaited."""
        self.agent.get_new_notifs()
        return NIXL_PROGRESS_S

    def poll(self, room: Room) -> str:
        state = self.agent.check_xfer_state(room.handle)
        if state != "PROC":
            self._release(room)
        return state

    def _release(self, room: Room) -> None:
        self._in_flight.pop(room.room, None)
        handle, room.handle = room.handle, None
        self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Release the agent now, while the pool is still mapped and every library loaded.

        Left to the interpreter's exit, NIXL's progress thread and UCX's teardown
        ran after the exit handlers of the libraries under them (memsvc died of
        SIGSEGV in libnl-route after "memsvc stopped"). Best effort: nothing here
        may keep memsvc from unlinking its pool.
        """
        if self.agent is None:
            return
        for room in list(self._in_flight.values()):
            with contextlib.suppress(Exception):  # cancels a transfer still in flight
                self._release(room)
        for name in self._remotes.values():
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._registered)
        self._in_flight.clear()
        self._remotes.clear()
        self.agent = None  # the last reference: NIXL destroys the agent and its threads


class ZmqMover:
    """Pages as raw bytes frames on the peer socket (the fallback without NIXL)."""

    name = "zmq"

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def describe(self) -> dict[str, Any]:
        return {}

    def start(
        self,
        room: Room,
        dest: dict[str, Any],
        dst_pages: np.ndarray,
        peer,
        dst_swa_pages: np.ndarray | None = None,
    ) -> None:
        """The room's full pages, then (hybrid) its window's SWA pages (``pool: swa``)."""
        buffers = self.pool.buffers
        page_shape = buffers.layout.kv_shape[1:]
        full_pages = room.pages if buffers.layout.bytes_per_page else room.pages[:0]
        for start in range(0, full_pages.size, CHUNK_PAGES):
            chunk = full_pages[start : start + CHUNK_PAGES]
            # one gather into the frame (device to host on the cuda backend)
            payload = np.empty((chunk.size, *page_shape), buffers.layout.storage_dtype)
            buffers.gather_pages(chunk, payload)
            peer.send_multipart(
                pack_frames({"t": "data", "room": room.room, "start": start}, payload)
            )
        if room.swa_pages is None:
            return
        for start in range(0, room.swa_pages.size, CHUNK_PAGES):
            chunk = room.swa_pages[start : start + CHUNK_PAGES]
            payload = np.ascontiguousarray(buffers.swa_kv[chunk])  # shm: a host array
            header = {"t": "data", "room": room.room, "start": start, "pool": "swa"}
            peer.send_multipart(pack_frames(header, payload))

    def progress(self) -> None:
        """Nothing to advance (None): the pages come as frames on the listener."""

    def poll(self, room: Room) -> str:
        return "DONE"

    def close(self) -> None:
        pass
