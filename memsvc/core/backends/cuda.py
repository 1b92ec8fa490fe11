"""CUDA backend: cupy device buffers shared by CUDA IPC, pinned host memory.

Only imported when ``backend="cuda"`` is asked for; cupy is the optional
``gpu`` extra. The KV buffer and the device ``req_to_token`` table are plain
``cudaMalloc`` allocations (not cupy's pool, so an IPC handle maps exactly
the buffer), exported with ``cudaIpcGetMemHandle``; attachers open them with
``cudaIpcOpenMemHandle`` and see them as cupy arrays or, through DLPack, torch
tensors. The control plane keeps a host mirror of ``req_to_token``.

Copies between the pool and the host store are large ``cudaMemcpyAsync``
runs on a dedicated copy stream. An offload (:meth:`CudaBuffers.copy_out_async`)
returns at once with an event recorded after its copies; the pool keeps the
pages it reads off the free list, and the host entry it writes unreadable,
until that event has completed. Loads and the other copies wait for their
stream before returning, so the model worker never reads a half-loaded page.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from memsvc.core.backends.base import AttachedBuffers, KVBuffers, aligned_pages, page_runs
from memsvc.core.errors import BackendUnavailableError
from memsvc.core.fence import CopyFence, EventFence
from memsvc.core.layout import PoolLayout

_HOST_TO_DEVICE = 1  # cudaMemcpyKind
_DEVICE_TO_HOST = 2


def import_cupy() -> Any:
    """cupy, or a clear error saying why the cuda backend cannot run here."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            "backend 'cuda' needs cupy: pip install 'kvstack[gpu]' (or use --backend shm)"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise BackendUnavailableError(f"backend 'cuda': no usable CUDA driver/GPU ({exc})") from exc
    if count == 0:
        raise BackendUnavailableError("backend 'cuda': no GPU found (use --backend shm)")
    return cupy


class CudaBuffers(KVBuffers):
    def __init__(self, layout: PoolLayout, device: int = 0, pinned_host: bool = True) -> None:
        """``pinned_host=False`` gives a pageable host store (for comparison only:
        copies from pageable memory are staged by the driver and run slower)."""
        if layout.is_hybrid:
            raise BackendUnavailableError(
                "backend 'cuda' has no SWA pool yet: a hybrid (sliding-window) layout runs on "
                "--backend shm"
            )
        cp = import_cupy()
        self.pinned_host = pinned_host
        self._cp = cp
        self.layout = layout
        if not 0 <= device < cp.cuda.runtime.getDeviceCount():
            raise BackendUnavailableError(f"backend 'cuda': no GPU with index {device}")
        self.device = device
        with cp.cuda.Device(device):
            try:
                self._kv_mem = cp.cuda.Memory(layout.kv_bytes)
                self._r2t_mem = cp.cuda.Memory(layout.req_to_token_bytes)
            except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
                raise BackendUnavailableError(
                    f"GPU {device} has no room for the KV pool "
                    f"({layout.kv_bytes / 2**30:.2f} GiB): lower --num-pages ({exc})"
                ) from exc
            self.kv = cp.ndarray(
                layout.kv_shape, layout.storage_dtype, cp.cuda.MemoryPointer(self._kv_mem, 0)
            )
            self.req_to_token_device = cp.ndarray(
                layout.req_to_token_shape, np.int32, cp.cuda.MemoryPointer(self._r2t_mem, 0)
            )
            self.req_to_token_device.fill(0)
            self.stream = cp.cuda.Stream(non_blocking=True)
            cp.cuda.runtime.deviceSynchronize()
        self.req_to_token = np.zeros(layout.req_to_token_shape, dtype=np.int32)
        self._closed = False

    def handle(self) -> dict[str, Any]:
        runtime = self._cp.cuda.runtime
        return {
            "backend": "cuda",
            "layout": self.layout.to_dict(),
            "device": self.device,
            "owner_pid": os.getpid(),
            "kv_ipc": bytes(runtime.ipcGetMemHandle(self._kv_mem.ptr)),
            "req_to_token_ipc": bytes(runtime.ipcGetMemHandle(self._r2t_mem.ptr)),
        }

    def write_row(self, row: int, start: int, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=np.int32)
        self.req_to_token[row, start : start + values.size] = values
        with self._cp.cuda.Device(self.device):
            self.req_to_token_device[row, start : start + values.size].set(values, self.stream)
            self.stream.synchronize()

    def write_cells(self, rows: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
        cp = self._cp
        self.req_to_token[rows, positions] = values
        with cp.cuda.Device(self.device):
            self.req_to_token_device[cp.asarray(rows), cp.asarray(positions)] = cp.asarray(
                values, dtype=np.int32
            )
            cp.cuda.runtime.deviceSynchronize()

    def alloc_host(self, num_pages: int) -> np.ndarray:
        shape = (num_pages, *self.layout.kv_shape[1:])
        count = int(np.prod(shape))
        nbytes = max(count * self.layout.itemsize, 1)
        if self.pinned_host:
            memory = self._cp.cuda.alloc_pinned_memory(nbytes)
        else:
            memory = mmap.mmap(-1, nbytes)
        return np.frombuffer(memory, self.layout.storage_dtype, count).reshape(shape)

    def _enqueue_runs(self, host: np.ndarray, pages: np.ndarray, kind: int) -> None:
        """One ``cudaMemcpyAsync`` per run of consecutive pages, on the copy stream."""
        page_bytes = self.layout.bytes_per_page
        host_ptr = host.ctypes.data
        runtime = self._cp.cuda.runtime
        for index, first_page, length in page_runs(pages):
            device_ptr = self._kv_mem.ptr + first_page * page_bytes
            host_at = host_ptr + index * page_bytes
            src, dst = (device_ptr, host_at) if kind == _DEVICE_TO_HOST else (host_at, device_ptr)
            runtime.memcpyAsync(dst, src, length * page_bytes, kind, self.stream.ptr)

    def _copy_runs(self, host: np.ndarray, pages: np.ndarray, kind: int) -> None:
        with self._cp.cuda.Device(self.device):
            self._enqueue_runs(host, pages, kind)
            self.stream.synchronize()

    def copy_out_async(self, slots: np.ndarray, out: np.ndarray) -> CopyFence:
        pages = aligned_pages(slots, self.layout.page_size)
        if pages is None:  # a gather by token (unaligned layout): synchronous
            return super().copy_out_async(slots, out)
        with self._cp.cuda.Device(self.device):
            self._enqueue_runs(out, pages, _DEVICE_TO_HOST)
            event = self._cp.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
        return EventFence(event)

    def gather_pages(self, pages: np.ndarray, out: np.ndarray) -> None:
        self._copy_runs(out, pages, _DEVICE_TO_HOST)

    def scatter_pages(self, src: np.ndarray, pages: np.ndarray) -> None:
        self._copy_runs(np.ascontiguousarray(src), pages, _HOST_TO_DEVICE)

    def zero_pages(self, pages: np.ndarray, *, swa: bool = False) -> None:
        """One ``cudaMemsetAsync`` per run of pages on the copy stream (after any copy
        still queued there), then wait."""
        page_bytes = self.layout.bytes_per_page
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device):
            for _, first, length in page_runs(np.asarray(pages, dtype=np.int64)):
                ptr = self._kv_mem.ptr + first * page_bytes
                runtime.memsetAsync(ptr, 0, length * page_bytes, self.stream.ptr)
            self.stream.synchronize()

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        cp = self._cp
        page_size = self.layout.page_size
        with cp.cuda.Device(self.device):
            return cp.asnumpy(
                self.kv[cp.asarray(slots // page_size), :, :, cp.asarray(slots % page_size)]
            )

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        cp = self._cp
        page_size = self.layout.page_size
        with cp.cuda.Device(self.device):
            pages, offsets = cp.asarray(slots // page_size), cp.asarray(slots % page_size)
            self.kv[pages, :, :, offsets] = cp.asarray(data)
            cp.cuda.runtime.deviceSynchronize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stream.synchronize()  # no copy may touch the buffers after this
        self.kv = self.req_to_token_device = None
        self._kv_mem = self._r2t_mem = None  # cudaFree when the last reference goes


class CudaAttached(AttachedBuffers):
    def __init__(self, handle: dict[str, Any]) -> None:
        cp = import_cupy()
        self._cp = cp
        self.layout = PoolLayout.from_dict(handle["layout"])
        self.device = int(handle["device"])
        self._ptrs: list[int] = []
        with cp.cuda.Device(self.device):
            self.kv = self._open(
                handle["kv_ipc"],
                self.layout.kv_bytes,
                self.layout.kv_shape,
                self.layout.storage_dtype,
            )
            self.req_to_token = self._open(
                handle["req_to_token_ipc"],
                self.layout.req_to_token_bytes,
                self.layout.req_to_token_shape,
                np.int32,
            )

    def _open(self, ipc_handle: bytes, size: int, shape: tuple[int, ...], dtype: Any) -> Any:
        cp = self._cp
        try:
            ptr = cp.cuda.runtime.ipcOpenMemHandle(ipc_handle)
        except cp.cuda.runtime.CUDARuntimeError as exc:
            raise BackendUnavailableError(
                f"cannot open the pool's CUDA IPC handle on GPU {self.device} ({exc}); the "
                "attacher must run in another process on the same host and IPC namespace "
                "(docker: ipc: host) and see the same GPU"
            ) from exc
        self._ptrs.append(ptr)
        memory = cp.cuda.UnownedMemory(ptr, size, self)
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))

    def kv_torch(self) -> Any:
        import torch

        tensor = torch.from_dlpack(self.kv)
        return tensor.view(torch.bfloat16) if self.layout.dtype == "bfloat16" else tensor

    def req_to_token_torch(self) -> Any:
        import torch

        return torch.from_dlpack(self.req_to_token)

    def close(self) -> None:
        self.kv = self.req_to_token = None
        with self._cp.cuda.Device(self.device):
            for ptr in self._ptrs:
                self._cp.cuda.runtime.ipcCloseMemHandle(ptr)
        self._ptrs = []
