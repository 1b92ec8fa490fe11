"""The storage tier through NIXL's POSIX storage plugin (``--hicache-storage-backend nixl``).

Same sealed page files as :class:`~memsvc.core.storage.file.FileStorage` (one
``<key>.kvpage`` per page in this memsvc's own directory, created, opened and
checked the same way), but the bytes move by NIXL transfers between a registered
DRAM staging record and the registered file, so
the same code reaches any store a NIXL storage plugin serves (GDS, OBJ, ...)
once its plugin name and file registration are swapped in. Needs the
``nixl-cu12`` wheel with its POSIX plugin (``nixl_agent.get_plugin_list()``).
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np

from memsvc.core.errors import BackendUnavailableError
from memsvc.core.storage.file import FileStorage
from memsvc.core.storage.tierdir import SUFFIX, StorageDir

PLUGIN = "POSIX"


class NixlStorage(FileStorage):
    name = "nixl"

    def __init__(self, directory: StorageDir, page_bytes: int, timeout_s: float = 30.0) -> None:
        super().__init__(directory, page_bytes)
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise BackendUnavailableError(
                f"--hicache-storage-backend nixl needs the nixl-cu12 wheel: {exc}"
            ) from exc
        self._agent = nixl_agent(
            f"kvstack-hicache-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[])
        )
        if PLUGIN not in self._agent.get_plugin_list():
            raise BackendUnavailableError(f"this NIXL build has no {PLUGIN} storage plugin")
        self._agent.create_backend(PLUGIN, {})
        size = self.record_bytes
        self._staging = np.zeros(size, dtype=np.uint8)
        self._addr = self._staging.ctypes.data
        self._dram = [(self._addr, size, 0)]
        self._reg = self._agent.register_memory([(self._addr, size, 0, "")], "DRAM")
        self._timeout_s = timeout_s

    def _xfer(self, op: str, key: str, fd: int) -> None:
        agent, size = self._agent, self.record_bytes
        file_reg = agent.register_memory([(0, size, fd, key)], "FILE")
        handle = None
        try:
            local = agent.get_xfer_descs(self._dram, "DRAM")
            remote = agent.get_xfer_descs([(0, size, fd)], "FILE")
            handle = agent.initialize_xfer(op, local, remote, agent.name)
            state = agent.transfer(handle)
            deadline = time.monotonic() + self._timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise OSError(f"NIXL {op} of storage page {key} timed out")
                time.sleep(0)
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise OSError(f"NIXL {op} of storage page {key} failed")
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            agent.deregister_memory(file_reg)

    def _write_record(self, fd: int, key: str, data: memoryview, trailer: bytes) -> None:
        page_bytes = self.page_bytes
        self._staging[:page_bytes] = np.frombuffer(data, dtype=np.uint8)
        self._staging[page_bytes:] = np.frombuffer(trailer, dtype=np.uint8)
        os.ftruncate(fd, self.record_bytes)
        self._xfer("WRITE", key, fd)
        os.fsync(fd)

    def _read_record(self, fd: int, key: str, data: memoryview, trailer: bytearray) -> str | None:
        self._xfer("READ", key, fd)
        page_bytes = self.page_bytes
        np.frombuffer(data, dtype=np.uint8)[:] = self._staging[:page_bytes]
        trailer[:] = self._staging[page_bytes:].tobytes()
        return None

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        super().close()


__all__ = ["SUFFIX", "NixlStorage"]
