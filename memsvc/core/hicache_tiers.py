"""The hierarchical cache's lower tiers and the copies between them.

:class:`HostTier` is the host arena (whole pool pages, a free list; the tree
indexes it), :func:`page_hash_chain` names storage pages, and
:class:`TierCopies` runs every copy (device <-> host, host -> storage,
storage -> device, storage deletes) as one job on the buffers' copy thread
(:meth:`KVBuffers.submit`), in issue order. Storage reads are verified here:
a page that fails its checksum ends the load (:class:`StoredPageError`,
naming the good pages before it); a page write that fails is queued in
``failed_writes`` for the tree to reap. What the tree does with the tiers is
:mod:`memsvc.core.hicache`'s.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memsvc.core.allocator import PageAllocator
from memsvc.core.backends.base import KVBuffers, page_runs
from memsvc.core.errors import IntegrityError, StoredPageError
from memsvc.core.fence import DONE, CopyFence, FailedFence
from memsvc.core.storage import StorageBackend

log = logging.getLogger("memsvc")


@dataclass
class HiCacheStats:
    hit_tokens: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "storage": 0}
    )
    load_bytes: int = 0
    load_tokens: int = 0
    load_seconds: float = 0.0
    backup_bytes: int = 0
    backup_tokens: int = 0
    backup_seconds: float = 0.0
    storage_write_bytes: int = 0  # issued to the copy thread
    storage_written_bytes: int = 0  # whose write completed (on the copy thread)
    storage_read_bytes: int = 0
    storage_seconds: float = 0.0
    dropped_tokens: int = 0
    storage_load_failures: int = 0  # loads that met a page failing verification
    storage_write_failures: int = 0  # pages of storage backups that a failed write undid
    backups: int = 0  # copy jobs, for the duration summaries
    loads: int = 0
    # Off-device match parts left to recompute as not worth a load, by why: under
    # LOAD_BACK_THRESHOLD ("threshold") or dearer than recomputing ("cost").
    load_skips: dict[str, int] = field(default_factory=lambda: {"threshold": 0, "cost": 0})
    load_skip_tokens: dict[str, int] = field(default_factory=lambda: {"threshold": 0, "cost": 0})


class HostTier:
    """A host arena of whole pool pages with a free list (no entries: the tree indexes it)."""

    def __init__(self, buffers: KVBuffers, num_pages: int) -> None:
        self.num_pages = num_pages
        self.page_bytes = buffers.layout.bytes_per_page
        self.arena = buffers.alloc_host(num_pages)
        self.arena.view(np.uint8).reshape(-1)[::4096] = 0  # fault every OS page in now
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)  # stack: page 0 first
        self._num_free = num_pages
        self.in_use = np.zeros(num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._num_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._num_free:
            return None
        top = self._num_free
        pages = self._free[top - n : top][::-1].copy()
        self._num_free -= n
        self.in_use[pages] = True
        return pages

    def free(self, pages: np.ndarray) -> None:
        if not self.in_use[pages].all():
            raise IntegrityError("host tier: freeing a host page that is not in use")
        self.in_use[pages] = False
        top = self._num_free
        self._free[top : top + pages.size] = pages[::-1]
        self._num_free += pages.size

    def free_list(self) -> np.ndarray:
        return self._free[: self._num_free].copy()


class TierCopies:
    """Every copy between the tiers, each one job on the buffers' copy thread.

    Each call issues its job and returns the job's fence; a load (it writes
    pool pages) makes pages freed from then on wait for it
    (``allocator.copy_issued``), a backup only the pages it reads
    (``allocator.copy_reads``): a request's pages freed while a backup runs
    do not wait for it. Jobs run in issue order, so a page or key freed while
    a job still uses it is reused only by a later job.
    """

    def __init__(
        self,
        buffers: KVBuffers,
        allocator: PageAllocator,
        host: HostTier,
        stats: HiCacheStats,
    ) -> None:
        self.buffers = buffers
        self.allocator = allocator
        self.host = host
        self.stats = stats
        self.failed_writes: deque[list[str]] = deque()  # appended by the copy thread
        self._last_fence: CopyFence = DONE

    def to_host(self, dev_pages: np.ndarray, host_pages: np.ndarray) -> CopyFence:
        fence = self._submit(self._job_to_host, dev_pages, host_pages, pool_pages=False)
        self.allocator.copy_reads(fence, dev_pages)  # those pages, if freed, wait for it
        return fence

    def from_host(self, host_pages: np.ndarray, dev_pages: np.ndarray) -> CopyFence:
        return self._submit(self._job_from_host, host_pages, dev_pages, pool_pages=True)

    def to_storage(
        self, storage: StorageBackend, host_pages: np.ndarray, keys: list[str]
    ) -> CopyFence:
        return self._submit(self._job_host_to_storage, storage, host_pages, keys, pool_pages=False)

    def from_storage(
        self, storage: StorageBackend, keys: list[str], dev_pages: np.ndarray
    ) -> CopyFence:
        """Load verified pages; the fence fails (:class:`StoredPageError`) at the first
        page that does not verify, after the good ones before it were copied."""
        return self._submit(self._job_from_storage, storage, keys, dev_pages, pool_pages=True)

    def zero_host(self, arena: np.ndarray, pages: np.ndarray) -> CopyFence:
        """Zero host pages just freed (--zero-freed-kv), after every job still reading them."""
        return self._submit(self._job_zero_host, arena, pages.copy(), pool_pages=False)

    def delete(self, storage: StorageBackend, keys: list[str]) -> CopyFence:
        return self._submit(self._job_storage_delete, storage, keys, pool_pages=False)

    def take_failed_writes(self) -> set[str]:
        """The keys of every storage write that failed since the last call."""
        failed: set[str] = set()
        while self.failed_writes:
            failed.update(self.failed_writes.popleft())
        return failed

    def settle(self) -> None:
        """Wait for every copy issued so far."""
        self._last_fence.wait()

    def _submit(self, fn: Callable[..., Any], *args: Any, pool_pages: bool) -> CopyFence:
        try:
            fence = self.buffers.submit(fn, *args)
        except StoredPageError as exc:  # a backend that copies at once (cuda): as if later
            fence = FailedFence(exc)
        self._last_fence = fence
        if pool_pages and not fence.done():
            # Pages freed from now on wait for it. (A copy that ran synchronously must not
            # replace the fence of an asynchronous offload still running.)
            self.allocator.copy_issued(fence)
        return fence

    # -- the jobs (on the copy thread) ----------------------------------------------

    def _job_to_host(self, dev_pages: np.ndarray, host_pages: np.ndarray) -> None:
        started = time.perf_counter()
        arena = self.host.arena
        for index, first, length in page_runs(host_pages):
            self.buffers.gather_pages(
                dev_pages[index : index + length], arena[first : first + length]
            )
        self.stats.backup_seconds += time.perf_counter() - started

    def _job_from_host(self, host_pages: np.ndarray, dev_pages: np.ndarray) -> None:
        started = time.perf_counter()
        arena = self.host.arena
        for index, first, length in page_runs(host_pages):
            self.buffers.scatter_pages(
                arena[first : first + length], dev_pages[index : index + length]
            )
        self.stats.load_seconds += time.perf_counter() - started

    def _job_host_to_storage(
        self, storage: StorageBackend, host_pages: np.ndarray, keys: list[str]
    ) -> None:
        """Write a node's pages; one that fails fails the node's storage copy (queued in
        ``failed_writes``), and the pages after it are not tried."""
        started = time.perf_counter()
        for page, key in zip(host_pages.tolist(), keys, strict=True):
            try:
                storage.put(key, self.host.arena[page])
            except OSError as exc:
                self.stats.storage_write_failures += len(keys)  # the node's whole copy fails
                log.warning("hicache storage: writing page %s failed: %s", key, exc)
                self.failed_writes.append(keys)
                break
            self.stats.storage_written_bytes += self.host.page_bytes
        self.stats.storage_seconds += time.perf_counter() - started

    def _job_from_storage(
        self, storage: StorageBackend, keys: list[str], dev_pages: np.ndarray
    ) -> None:
        """Load verified pages; at the first that fails, copy the good ones before it and
        raise :class:`StoredPageError` naming them."""
        started = time.perf_counter()
        staging = self.buffers.alloc_host(len(keys))
        num_good, why = 0, None
        for i, key in enumerate(keys):
            why = storage.get(key, staging[i])
            if why is not None:
                break
            num_good += 1
        if num_good:
            self.buffers.scatter_pages(staging[:num_good], dev_pages[:num_good])
        self.stats.load_seconds += time.perf_counter() - started
        if why is not None:
            self.stats.storage_load_failures += 1
            log.warning("hicache storage: page %s failed verification: %s", keys[num_good], why)
            raise StoredPageError(
                f"storage page {keys[num_good]} is unusable: {why}", frozenset(keys[:num_good])
            )

    def _job_zero_host(self, arena: np.ndarray, pages: np.ndarray) -> None:
        arena[pages] = 0

    def _job_storage_delete(self, storage: StorageBackend, keys: list[str]) -> None:
        for key in keys:
            storage.delete(key)
