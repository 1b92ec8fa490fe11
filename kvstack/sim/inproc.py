"""memsvc in process: the real client and service code, no socket in between.

:class:`InProcessMem` is the memsvc client (the same op definitions and reply
checking as :class:`~memsvc.client.AsyncMemClient`) wired straight to a
:class:`~memsvc.handlers.MemService`. Every op is still packed, handled and
unpacked exactly as over the wire, so the scheduler cannot tell the
difference; only the transport is gone. The simulator and the engine tests
share it. :class:`SimMem` adds the simulator's accounting on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstack.sim.costmodel import CostModel, SimClock
from memsvc import protocol as wire
from memsvc.client import _Call, _Client, _Session
from memsvc.core import KVPool, PoolLayout
from memsvc.handlers import MemService, ServiceConfig
from memsvc.ops import AllocResult, RetractReply

# The sim never reads KV: one layer, one head, head dim 1 keeps the buffer at
# 4 bytes per token, so a GPU-sized pool (hundreds of thousands of tokens)
# costs a few MiB of shared memory.
TINY_KV_DIMS: dict[str, int] = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1}


class InProcessMem(_Client):
    def __init__(self, service: MemService, name: str = "scheduler") -> None:
        self._service = service
        # Nothing expires leases in process (no reaper runs): the longest memsvc takes.
        lease_s = ServiceConfig.max_lease_s
        self._state = _Session("inproc://memsvc", "scheduler", name, lease_s, 1.0, 0, None)

    @classmethod
    async def connect(
        cls, service: MemService, name: str = "scheduler", **kwargs: Any
    ) -> InProcessMem:
        """A client with an open session (``hello`` done), like ``AsyncMemClient.connect``."""
        client = cls(service, name, **kwargs)
        await client._invoke(client._state.hello_call())
        return client

    async def _invoke(self, call: _Call) -> Any:
        _, frames = self._state.frames(call)
        header = wire.unpack(self._service.handle(frames))
        return self._state.finish(call, header)


def tiny_layout(
    num_tokens: int, page_size: int, max_running_requests: int, max_context_len: int
) -> PoolLayout:
    """A pool of ``num_tokens`` (rounded down to pages) with the smallest KV per token."""
    return PoolLayout(
        **TINY_KV_DIMS,
        page_size=page_size,
        num_pages=max(num_tokens // page_size, 1),
        max_running_requests=max_running_requests,
        max_context_len=max_context_len,
    )


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
    mode: str  # the mode the engine asked for
    retracted: tuple[str, ...]  # in retract order (least worth keeping first)
    offloaded_tokens: int  # tokens of KV copied to the host store by this retract
    last_does_not_fit: bool


class SimMem(InProcessMem):
    """InProcessMem that charges memsvc's share of simulated time and logs retracts.

    The copy hook lives here, at the memsvc edge, because every KV copy the
    engine causes passes through exactly three ops, whatever the engine's
    retract mode: ``retract`` (victims it offloads, in ``offload`` or
    per-row ``mixed`` mode), ``offload`` and ``load``. After each, the
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
        self._observers: dict[str, Callable[[_Call, Any], None]] = {
            "retract": self._on_retract,
            "offload": self._on_offload,
            "load": self._on_load,
        }

    async def _invoke(self, call: _Call) -> Any:
        result = await super()._invoke(call)
        if self.cost.memsvc_op_s:
            self.clock.charge("memsvc", self.cost.memsvc_op_s)
        observe = self._observers.get(call.op)
        if observe is not None:
            observe(call, result)
        return result

    def _copy(self, num_tokens: int, *, offload: bool) -> None:
        if offload:
            self.offloaded_tokens += num_tokens
        else:
            self.loaded_tokens += num_tokens
        self.clock.charge("copy", self.cost.copy_seconds(num_tokens))

    def _on_retract(self, call: _Call, reply: RetractReply) -> None:
        # Whatever the mode ("offload", or "mixed" with a per-row choice), a victim
        # whose KV was copied is the one the host store now holds.
        store = self._service.pool.host_store
        tokens = sum(store.num_tokens(rid) for rid in reply.retracted if rid in store)
        if tokens:
            self._copy(tokens, offload=True)
        self.retracts.append(
            RetractEvent(
                self.clock.now,
                str(call.fields.get("mode")),
                tuple(reply.retracted),
                tokens,
                bool(reply.last_does_not_fit),
            )
        )

    def _on_offload(self, call: _Call, nbytes: int) -> None:
        self._copy(self._service.pool.host_store.num_tokens(call.fields["rid"]), offload=True)

    def _on_load(self, call: _Call, result: AllocResult) -> None:
        if result.fits and result.slots is not None:
            self._copy(len(result.slots), offload=False)
