"""Whether loading a match's off-device part back is cheaper than recomputing it.

A match that runs into host / storage nodes may load them into fresh device
pages (:meth:`HiRadixCache._load_back`) or stop at the device prefix and let
the request recompute them. :class:`LoadCostModel` compares the two::

    load_s      = copy_latency_s + tail_bytes / copy_bytes_per_s
    recompute_s = tail_tokens × recompute_s_per_token
    load when  tail_tokens >= LOAD_BACK_THRESHOLD  and  load_s <= recompute_s

SGLang's ``load_back_threshold`` (10 tokens) stays the floor: under it nothing
is loaded, whatever the model says.

Where the two rates come from:

- the copy path's, measured when the cache is created (:func:`calibrate_copy`:
  host-tier pages copied into pool pages on the buffers' copy thread, the way
  a load runs, a one-page job for the latency and one of up to 32 MB for the
  bandwidth; nothing uses the pool yet), or ``--hicache-copy-bandwidth``;
- the worker's, from the scheduler: it learns its prefill tokens per second
  from the passes it runs and sends the per-token time with each ``admit``
  (:meth:`observe_recompute`), or ``--hicache-recompute-us-per-token`` fixes it.
  Until a rate is known, every load above the floor is made (as without the
  model), and so with ``--hicache-disable-load-cost-model``.

A storage page is read from its file before its copy: the model prices it at
the copy path's rate too, so it only ever errs towards loading.
"""

from __future__ import annotations

import time

import numpy as np

from memsvc.core.backends.base import KVBuffers
from memsvc.core.hicache_config import HiCacheConfig

# The bytes one calibration copy moves (at most: the tiers may be smaller). Larger than
# a CPU's last-level cache, or the copy runs from cache at several times a load's speed.
CALIBRATION_BYTES = 32 << 20
CALIBRATION_REPEATS = 3


def _time_copy(buffers: KVBuffers, src: np.ndarray, pages: np.ndarray) -> float:
    """Best-of seconds of one host -> pool copy job, handed to the copy thread and waited."""
    best = float("inf")
    for _ in range(CALIBRATION_REPEATS):
        started = time.perf_counter()
        buffers.submit(buffers.scatter_pages, src, pages).wait()
        best = min(best, time.perf_counter() - started)
    return best


def calibrate_copy(buffers: KVBuffers, host_arena: np.ndarray, num_device_pages: int) -> tuple:
    """``(latency_s, bytes_per_s)`` of a host -> device load on this machine.

    Copies host arena pages into the first pool pages, so call it before the
    pool holds anything (the tree's constructor).
    """
    page_bytes = buffers.layout.bytes_per_page
    num = max(1, min(CALIBRATION_BYTES // page_bytes, len(host_arena), num_device_pages))
    pages = np.arange(num, dtype=np.int64)
    one = _time_copy(buffers, host_arena[:1], pages[:1])
    many = _time_copy(buffers, host_arena[:num], pages)
    bandwidth = num * page_bytes / max(many, 1e-9)  # its latency in: a little low
    latency = max(one - page_bytes / bandwidth, 0.0)
    return latency, bandwidth


class LoadCostModel:
    """The load-or-recompute decision (module docstring); its counters are the stats'."""

    def __init__(
        self,
        *,
        enabled: bool,
        copy_latency_s: float,
        copy_bytes_per_s: float,
        recompute_s_per_token: float | None = None,
        fixed_recompute: bool = False,
    ) -> None:
        self.enabled = enabled
        self.copy_latency_s = copy_latency_s
        self.copy_bytes_per_s = copy_bytes_per_s
        self.recompute_s_per_token = recompute_s_per_token
        self._fixed_recompute = fixed_recompute  # set by flag: admits do not change it

    @classmethod
    def for_config(
        cls, config: HiCacheConfig, buffers: KVBuffers, host_arena: np.ndarray, device_pages: int
    ) -> LoadCostModel:
        """The model ``config`` asks for; the copy path timed now unless a flag sets it."""
        enabled = not config.disable_load_cost_model
        if config.copy_gb_per_s > 0 or not enabled or not len(host_arena):
            latency, bandwidth = 0.0, (config.copy_gb_per_s or 1.0) * 1e9
        else:
            latency, bandwidth = calibrate_copy(buffers, host_arena, device_pages)
        fixed = config.recompute_us_per_token > 0
        return cls(
            enabled=enabled,
            copy_latency_s=latency,
            copy_bytes_per_s=bandwidth,
            recompute_s_per_token=config.recompute_us_per_token * 1e-6 if fixed else None,
            fixed_recompute=fixed,
        )

    def observe_recompute(self, seconds_per_token: float) -> None:
        """The worker's prefill time per token, as the scheduler last measured it."""
        if not self._fixed_recompute and seconds_per_token > 0:
            self.recompute_s_per_token = seconds_per_token

    def load_s(self, nbytes: int) -> float:
        return self.copy_latency_s + nbytes / self.copy_bytes_per_s

    def worth_loading(self, num_tokens: int, nbytes: int) -> bool:
        """Above the floor (the caller's check): is the copy no dearer than recomputing?"""
        if not self.enabled or self.recompute_s_per_token is None:
            return True
        return self.load_s(nbytes) <= num_tokens * self.recompute_s_per_token

    def as_dict(self) -> dict[str, float | bool | None]:
        return {
            "enabled": self.enabled,
            "copy_latency_s": self.copy_latency_s,
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "recompute_s_per_token": self.recompute_s_per_token,
        }
