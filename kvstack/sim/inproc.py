"""The simulator's memsvc: :class:`~memsvc.inproc.InProcessMem` with its accounting.

:class:`SimMem` is memsvc's in-process client (the real client and service
code, no socket in between) that charges memsvc's share of simulated time;
:func:`tiny_layout` and :func:`build_service` make the pool it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstack.sim.costmodel import CostModel, SimClock
from memsvc.client import AllocResult, RetractReply
from memsvc.core import KVPool, PoolLayout
from memsvc.core.layout import hybrid_layout
from memsvc.handlers import MemService, ServiceConfig
from memsvc.inproc import InProcessMem

# The sim never reads KV: one layer, one head, head dim 1 keeps the buffer at
# 4 bytes per token, so a GPU-sized pool (hundreds of thousands of tokens)
# costs a few MiB of shared memory.
TINY_KV_DIMS: dict[str, int] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1}


def tiny_layout(
    num_tokens: int,
    page_size: int,
    max_running_requests: int,
    max_context_len: int,
    *,
    layer_types: tuple[str, ...] = (),
    sliding_window: int = 0,
    swa_full_tokens_ratio: float = 0.8,
) -> PoolLayout:
    """A pool of ``num_tokens`` (rounded down to pages) with the smallest KV per token.

    With ``layer_types`` holding a sliding layer: a hybrid model's two pools in the
    bytes of ``num_tokens`` tokens of every layer (memsvc's ``--layer-types`` sizing).
    """
    dims = TINY_KV_DIMS if not layer_types else {**TINY_KV_DIMS, "num_layers": len(layer_types)}
    layout = PoolLayout(
        **dims,
        page_size=page_size,
        num_pages=max(num_tokens // page_size, 1),
        max_running_requests=max_running_requests,
        max_context_len=max_context_len,
    )
    if not layer_types:
        return layout
    return hybrid_layout(layout, layer_types, sliding_window, swa_full_tokens_ratio)


def build_service(
    layout: PoolLayout, *, host_store_tokens: int = 0, retract_decode_steps: int = 20
) -> MemService:
    """A MemService over a fresh shm KVPool; close it with ``service.pool.close()``."""
    host_bytes = host_store_tokens * layout.bytes_per_token
    pool = KVPool(layout, backend="shm", host_store_bytes=host_bytes)
    try:
        return MemService(pool, ServiceConfig(retract_decode_steps=retract_decode_steps))
    except BaseException:
        pool.close()
        raise


@dataclass(frozen=True, slots=True)
class RetractEvent:
    """One ``retract`` reply as the simulator saw it."""

    time: float  # simulated seconds, after the copy (if any) was charged
    targets: tuple[str, ...]  # the target the engine asked for, per row
    retracted: tuple[str, ...]  # in retract order (least worth keeping first)
    offloaded_tokens: int  # tokens of KV copied to the host store by this retract
    last_does_not_fit: bool


class SimMem(InProcessMem):
    """InProcessMem that charges memsvc's share of simulated time and logs retracts.

    The copy hook lives here, at the memsvc edge, because every KV copy the
    engine causes passes through exactly three ops, whatever the engine's
    retract mode: ``retract`` (victims whose target is ``host_entry``),
    ``offload`` and ``load``. After each, the
    tokens copied are read from the pool's host store (this layout's bytes
    per token are fake, so the reply's byte counts are not used) and the
    clock is charged ``tokens × cost.bytes_per_token / cost.copy_bytes_per_s``.
    The engine needs no hook for it. Copies are charged serially, as if the
    worker waited for them (no overlap with compute).
    """

    def __init__(
        self, service: MemService, name: str = "scheduler", *, clock: SimClock, cost: CostModel
    ) -> None:
        super().__init__(service, name)
        self.clock = clock
        self.cost = cost
        self.retracts: list[RetractEvent] = []
        self.offloaded_tokens = 0
        self.loaded_tokens = 0
        self._observers: dict[str, Callable[[dict[str, Any], Any], None]] = {
            "retract": self._on_retract,
            "offload": self._on_offload,
            "load": self._on_load,
        }

    def observe(self, op: str, fields: dict[str, Any], result: Any) -> None:
        if self.cost.memsvc_op_s:
            self.clock.charge("memsvc", self.cost.memsvc_op_s)
        on_op = self._observers.get(op)
        if on_op is not None:
            on_op(fields, result)

    def _copy(self, num_tokens: int, *, offload: bool) -> None:
        if offload:
            self.offloaded_tokens += num_tokens
        else:
            self.loaded_tokens += num_tokens
        self.clock.charge("copy", self.cost.copy_seconds(num_tokens))

    def _on_retract(self, fields: dict[str, Any], reply: RetractReply) -> None:
        # Whatever the targets asked for, a victim whose KV was copied is the one
        # the host store now holds.
        store = self.service.pool.host_store
        tokens = sum(store.num_tokens(rid) for rid in reply.retracted if rid in store)
        if tokens:
            self._copy(tokens, offload=True)
        self.retracts.append(
            RetractEvent(
                self.clock.now,
                tuple(map(str, fields["targets"])),
                tuple(reply.retracted),
                tokens,
                bool(reply.last_does_not_fit),
            )
        )

    def _on_offload(self, fields: dict[str, Any], nbytes: int) -> None:
        self._copy(self.service.pool.host_store.num_tokens(fields["rid"]), offload=True)

    def _on_load(self, fields: dict[str, Any], result: AllocResult) -> None:
        if result.fits and result.slots is not None:
            self._copy(len(result.slots), offload=False)
