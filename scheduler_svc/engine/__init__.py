"""The normal-mode scheduling loop: admission, prefill, decode, retract, re-prefill.

One :meth:`Engine.step` is one iteration of SGLang's loop, prefill first::

    commands (submit / abort) ─► prefill round? ──yes──► extend forward ─► merge into running
                                      │ no
                                      ▼
                        decode round: [test retract] decode_step ──fits──► decode forward
                                                        │ no
                                                        ▼
                                retract (memsvc pops victims in our order) ─► re-queue victims,
                                abort the last one if even it does not fit ─► decode_step again

memsvc does the memory side of each step in one round trip (``decode_step``
checks and allocates; ``retract`` releases until the step fits); the pure
core (``scheduler_svc.core``) decides admission, victim order and the
new-token ratio. Commands from clients are applied only between steps, so a
step never sees a request vanish under it.

The package: :mod:`~scheduler_svc.engine.base` (the state, commands,
endings and repairs), :mod:`~scheduler_svc.engine.prefill_round`,
:mod:`~scheduler_svc.engine.decode_round` (with retract),
:mod:`~scheduler_svc.engine.loop` (:class:`Engine`, the step) and
:mod:`~scheduler_svc.engine.stats`.
"""

from scheduler_svc.engine.base import HOLDS_KV, Emit, seed_from_rid
from scheduler_svc.engine.loop import Engine
from scheduler_svc.engine.stats import GEN_THROUGHPUT_PASSES, EngineStats

__all__ = ["GEN_THROUGHPUT_PASSES", "HOLDS_KV", "Emit", "Engine", "EngineStats", "seed_from_rid"]
