"""The engine's own timings, taken from the simulated clock instead of the wall clock.

``retract_mode=auto`` chooses per victim between recompute and offload (and a
decode node with a peer between moving a victim and keeping it) from a
:class:`~scheduler_svc.core.retract_cost.RetractCostModel` that the engine
feeds with wall-clock measurements (``time.perf_counter()`` around each
extend, decode pass, host-store load and move). In the simulator those calls take
microseconds of wall time, so the learned rates would be meaningless and
would vary from run to run. :class:`SimRetractCost` keeps the engine's
model and its learning rule, but replaces each measured duration by the
simulated seconds the worker or SimMem just charged for that call.

Units: the sim pool's layout has fake bytes per token (see
:data:`~kvstack.sim.inproc.TINY_KV_DIMS`), and the engine counts copy
bytes and host-store room in those units; its prior copy rate (real bytes/s)
is scaled into them so that ``offload_s`` comes out in real seconds.

(A cleaner hook would be an injectable time source on the Engine, e.g.
``Engine(..., clock=time.perf_counter)``; until then this wraps from outside.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvstack.sim.costmodel import CostModel, SimClock
from scheduler_svc.core.retract_cost import RetractCostModel


@dataclass
class SimRetractCost(RetractCostModel):
    clock: SimClock | None = None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        super().observe_prefill(tokens, self._last("prefill"))

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        super().observe_copy(nbytes, self._last("copy"))

    def observe_decode_step(self, seconds: float) -> None:
        super().observe_decode_step(self._last("decode"))

    def observe_move(self, nbytes: int, seconds: float) -> None:
        super().observe_move(nbytes, self._last("move"))

    def _last(self, kind: str) -> float:
        assert self.clock is not None
        return self.clock.last_s.get(kind, 0.0)


def clock_engine_costs(engine: Any, clock: SimClock, cost: CostModel) -> None:
    """Swap the engine's retract cost model for one timed by ``clock`` (if it has one)."""
    current = getattr(engine, "cost", None)
    if not isinstance(current, RetractCostModel):
        return
    values = {f.name: getattr(current, f.name) for f in fields(RetractCostModel)}
    if current.bytes_per_token and cost.bytes_per_token:
        scale = current.bytes_per_token / cost.bytes_per_token
        values["copy_bytes_per_s"] *= scale
        values["move_bytes_per_s"] *= scale
    engine.cost = SimRetractCost(**values, clock=clock)
