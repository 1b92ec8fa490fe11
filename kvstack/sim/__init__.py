"""The policy lab: the real scheduler and memsvc cores against a simulated model worker.

``kvstack sim`` runs the unmodified :class:`~scheduler_svc.engine.Engine` with
the real memsvc code (in process, no sockets) and a worker that returns
deterministic tokens and advances a *simulated* clock by a cost model
instead of computing. Every admission, retract and ratio decision is the
engine's own; the simulator only decides when requests arrive and how long
each forward pass and KV copy takes::

    workload ──arrivals──► Engine.step() ──extend/decode──► SimWorker ──► clock += cost
                               │                                          ▲
                               └──memsvc ops──► SimMem (InProcessMem) ────┘ offload/load bytes

Modules: :mod:`.inproc` (``SimMem``: memsvc's in-process client,
:mod:`memsvc.inproc`, charging KV copies), :mod:`.costmodel` (costs and the
clock), :mod:`.worker`, :mod:`.timing` (the engine's own timings on the simulated clock),
:mod:`.workload`, :mod:`.settings` (``--set`` / ``--sweep``), :mod:`.runner`
(one run), :mod:`.plots`, :mod:`.cli` (``kvstack sim``).
"""
