"""The storage tier through NIXL's POSIX storage plugin (``--hicache-storage-backend nixl``).

Same page files as :class:`~memsvc.core.storage.file.FileStorage` (one
``<key>.kvpage`` per page in the directory), but the bytes move by NIXL
transfers between a registered DRAM staging page and the registered file, so
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
from memsvc.core.storage.file import SUFFIX, FileStorage

PLUGIN = "POSIX"


class NixlStorage(FileStorage):
    name = "nixl"

    def __init__(self, directory: str, page_bytes: int, timeout_s: float = 30.0) -> None:
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
        self._staging = np.zeros(page_bytes, dtype=np.uint8)
        self._addr = self._staging.ctypes.data
        self._dram = [(self._addr, page_bytes, 0)]
        self._reg = self._agent.register_memory([(self._addr, page_bytes, 0, "")], "DRAM")
        self._timeout_s = timeout_s

    def _xfer(self, op: str, key: str, fd: int) -> None:
        agent = self._agent
        file_reg = agent.register_memory([(0, self.page_bytes, fd, key)], "FILE")
        handle = None
        try:
            local = agent.get_xfer_descs(self._dram, "DRAM")
            remote = agent.get_xfer_descs([(0, self.page_bytes, fd)], "FILE")
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

    def put(self, key: str, page: np.ndarray) -> None:
        self._staging[:] = np.ascontiguousarray(page).view(np.uint8).reshape(-1)
        path = self._path(key)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, self.page_bytes)
            self._xfer("WRITE", key, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def get(self, key: str, out: np.ndarray) -> bool:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size != self.page_bytes:
                return False
            self._xfer("READ", key, fd)
        finally:
            os.close(fd)
        out.view(np.uint8).reshape(-1)[:] = self._staging
        return True

    def close(self) -> None:
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None


__all__ = ["SUFFIX", "NixlStorage"]
