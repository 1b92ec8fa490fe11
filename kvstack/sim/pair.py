"""Two PD decode nodes in the simulator: a skewed load, with and without moving (issue 32).

``kvstack sim --skew`` runs each configuration twice on a pair of decode nodes of
``--pool-tokens`` each: every request goes to the first (hot) node, the second
(cold) one gets only what the hot one moves to it. ``migrate=off``: the hot node
keeps its retracted requests until it has room again; ``migrate=on``: it moves
them, with their KV, to the cold one (``--migrate-to``, the retract cost
model's ``--migrate-policy cost``). Both nodes run the real
:class:`~scheduler_svc.pd.decode.DecodeEngine` on real memsvc cores; what is
simulated:

- the prefill node: one FIFO server at ``prefill_tok_per_s``; a request's KV
  reaches the hot node once its prefill is done and the hot node has
  preallocated its pages;
- a move: the retracted request's host-store KV at ``copy_bytes_per_s``, from
  when the cold node has preallocated for it (it decides from its own budget,
  as :class:`~scheduler_svc.pd.migrate.MigrationPeer` asks a real one);
- time: each node has its own clock; the loop steps the node that is behind, so
  the two decode in parallel, as two machines would.

Tokens are the simulated worker's, so ``--check`` verifies that every moved
request decodes on to the tokens it would have had without the move.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvstack.sim.costmodel import SimClock
from kvstack.sim.inproc import SimMem, build_service, tiny_layout
from kvstack.sim.runner import RequestResult, Series, SimResult, request_totals
from kvstack.sim.settings import SimSpec
from kvstack.sim.timing import clock_engine_costs
from kvstack.sim.worker import EOS, SimWorker, expected_output, next_token
from kvstack.sim.workload import RequestSpec, prompt_tokens
from memsvc.handlers import MemService
from memsvc.transfer import KVPoll
from scheduler_svc.core import Req, SamplingParams, clamp_max_new_tokens
from scheduler_svc.core.config import RetractMode
from scheduler_svc.pd.decode import DecodeEngine
from scheduler_svc.pd.migrate import sampling_record

COLD_TRANSFER = "sim://cold/transfer"


@dataclass(slots=True)
class Move:
    """A request this node moves from its host store: sent from ``started``, its KV
    there at ``done`` (None until the peer has preallocated for it)."""

    rid: str
    started: float
    done: float | None = None
    counted: bool = False  # its tokens are in ``moved_tokens``


class PairMem(SimMem):
    """A decode node's memsvc: SimMem plus the PD transfer ops, their KV timed by the sim.

    ``ready[room]``: when the room's KV is here (sent by the prefill node or the
    peer); ``moves[room]``: this node's moves of requests from its host store.
    """

    def __init__(self, service: MemService, name: str = "scheduler", **kwargs: Any) -> None:
        super().__init__(service, name, **kwargs)
        self.expected: dict[int, str] = {}
        self.ready: dict[int, float] = {}
        self.first_tokens: dict[str, int] = {}
        self.moves: dict[int, Move] = {}
        self.peer: PairMem | None = None
        self.moved_tokens = 0

    async def pd_expect(self, rid: str, room: int) -> None:
        self.expected[room] = rid
        if room in self.ready:  # the prefill node's KV: it comes once preallocated
            self.ready[room] = max(self.ready[room], self.clock.now)
        move = self.peer.moves.get(room) if self.peer is not None else None
        if move is not None:  # a move: it starts now
            tokens = self.peer.service.pool.host_store.num_tokens(move.rid)
            move.done = max(self.clock.now, move.started) + self.cost.copy_seconds(tokens)
            self.ready[room] = move.done

    async def pd_send(self, rid: str, room: int, *args: Any, **kwargs: Any) -> None:
        assert kwargs.get("from_host"), "the simulated hot node sends only moves"
        self.moves[room] = Move(rid, self.clock.now)

    async def pd_status(self, rooms: list[int]) -> list[dict[str, Any]]:
        return [self._report(room) for room in rooms]

    async def pd_forget(self, rooms: list[int]) -> None:
        for room in rooms:
            for book in (self.expected, self.ready, self.moves):
                book.pop(room, None)

    def _report(self, room: int) -> dict[str, Any]:
        move = self.moves.get(room)
        if move is not None:  # this node's move
            arrived = move.done is not None and move.done <= self.clock.now
            if arrived and not move.counted:
                move.counted = True
                self.moved_tokens += self.service.pool.host_store.num_tokens(move.rid)
                self.clock.last_s["move"] = move.done - move.started
        else:
            at = self.ready.get(room)
            arrived = room in self.expected and at is not None and at <= self.clock.now
        rid = self.expected.get(room, "")
        return {
            "room": room,
            "state": KVPoll.SUCCESS if arrived else KVPoll.TRANSFERRING,
            "first_token": self.first_tokens.get(rid, -1),
            "cached_tokens": 0,
            "why": "",
        }

    def next_event(self) -> float | None:
        """The earliest time a transfer this node waits on completes, if one is timed."""
        times = [t for room, t in self.ready.items() if room in self.expected]
        times += [m.done for m in self.moves.values() if m.done is not None]
        return min(times, default=None)


class SimPeer:
    """The hot node's ``migration``: the cold node in process, asked as MigrationPeer asks."""

    address = "sim://cold"

    def __init__(self, hot: Node, cold: Node) -> None:
        self.hot, self.cold = hot, cold
        self.relays: dict[str, Any] = {}
        self.promised = 0  # slots promised since the cold node's last step

    async def room_for(self, tokens: int) -> str | None:
        engine = self.cold.engine
        if engine.retracted or engine.prealloc:
            return None
        if tokens > engine.prealloc_budget() - self.promised:
            return None
        self.promised += tokens
        return COLD_TRANSFER

    async def hand_over(self, req: Req, room: int) -> None:
        moved = Req(
            req.rid,
            list(req.origin_input_ids),
            SamplingParams.of(sampling_record(req.sampling_params)),
            output_ids=list(req.output_ids),
            bootstrap_room=room,
        )
        moved.arrive_migrated(req.retraction_count, req.cached_tokens)
        self.cold.clock.wait_until(self.hot.clock.now)  # an idle node's clock lags behind
        self.cold.engine.accept_migrated(moved)

    def refused(self, rid: str) -> str | None:
        return None

    async def cancel(self, rid: str) -> None:
        pass

    def finished(self, rid: str) -> None:
        pass


class Node:
    """One decode node: its clock, memsvc core and engine."""

    def __init__(self, name: str, pair: Pair, service: MemService) -> None:
        self.name = name
        self.pair = pair
        self.spec = pair.spec
        self.service = service
        self.clock = SimClock()

    async def start(self, config: Any) -> Node:
        self.mem = await PairMem.connect(self.service, clock=self.clock, cost=self.spec.cost)
        table = self.service.pool.table.array if self.spec.check_tokens else None
        stops = self._stop_lengths if self.pair.stop_lens else None
        worker = SimWorker(self.clock, self.spec.cost, stop_lengths=stops, table=table)
        self.engine = DecodeEngine(
            config,
            self.mem,
            worker,  # type: ignore[arg-type]  # duck-typed AsyncModelClient
            lambda req, finished: self.pair.emit(self, req, finished),
            eos_token_ids=(EOS,),
            capacity=self.service.pool.capacity,
        )
        self.engine.migrate_in_timeout_s = float("inf")  # wall time means nothing here
        clock_engine_costs(self.engine, self.clock, self.spec.cost)
        return self

    @property
    def busy(self) -> bool:
        return not self.engine.idle

    def _stop_lengths(self, rows: Any) -> np.ndarray:
        rid_of_row, stops = self.service.pool.rid_of_row, self.pair.stop_lens
        return np.array([stops[rid_of_row(r)] for r in rows.tolist()], dtype=np.int64)


class Pair:
    """The state of one skewed run (see the module docstring)."""

    def __init__(self, spec: SimSpec, workload: list[RequestSpec], seed: int, migrate: bool):
        self.spec = spec
        self.workload = sorted(workload, key=lambda r: r.arrival)
        self.seed = seed
        self.migrate = migrate
        self.records = {r.rid: RequestResult(r.rid, r.arrival, r.input_len, 0) for r in workload}
        self.prompts: dict[str, list[int]] = {}
        # where each request stops early (EOS), -1: at max_new_tokens (kvstack.sim.runner's)
        self.stop_lens: dict[str, int] = {}
        if any(r.stops_early for r in workload):
            self.stop_lens = {r.rid: -1 for r in workload}
        self.num_wrong_outputs = 0
        self.prefill_free_at = 0.0
        self.next_room = 1
        self.series = Series()

    async def run(self, services: list[MemService]) -> None:
        config = self.spec.scheduler_config()
        config = replace(config, retract_mode=RetractMode.OFFLOAD)  # a decode node offloads
        self.hot = await Node("hot", self, services[0]).start(config)
        self.cold = await Node("cold", self, services[1]).start(config)
        self.hot.mem.peer, self.cold.mem.peer = self.cold.mem, self.hot.mem
        self.peer = SimPeer(self.hot, self.cold)
        if self.migrate:
            self.hot.engine.migration = self.peer  # type: ignore[assignment]
        await self._drive()

    async def _drive(self) -> None:
        arrivals = deque(self.workload)
        nodes = (self.hot, self.cold)
        while True:
            if arrivals and not self.hot.busy:  # nothing to do there until the next one
                self.hot.clock.wait_until(arrivals[0].arrival)
            while arrivals and arrivals[0].arrival <= self.hot.clock.now:
                self._submit(arrivals.popleft())
            busy = [n for n in nodes if n.busy]
            if not busy:
                return
            node = min(busy, key=lambda n: n.clock.now)
            before = len(node.mem.retracts)
            progressed = await node.engine.step()
            if node is self.cold:
                self.peer.promised = 0
            if node is self.hot:
                self._sample(before)
            if not progressed:
                self._wait(node, arrivals)

    def _wait(self, node: Node, arrivals: deque[RequestSpec]) -> None:
        """``node`` could do nothing now: jump its clock to the next thing it waits on
        (a transfer, the other node's time, an arrival)."""
        other = self.cold if node is self.hot else self.hot
        times = [node.mem.next_event()]
        if other.busy:
            times.append(other.clock.now)
        if node is self.hot and arrivals:
            times.append(arrivals[0].arrival)
        later = [t for t in times if t is not None and t > node.clock.now]
        if not later:
            raise RuntimeError(f"sim: the {node.name} node waits on nothing that will happen")
        node.clock.wait_until(min(later))

    def _submit(self, spec: RequestSpec) -> None:
        """The request's prefill, FIFO on the simulated prefill node, then the hot node."""
        record = self.records[spec.rid]
        capacity = self.hot.service.pool.capacity
        max_new = clamp_max_new_tokens(
            spec.input_len, spec.max_new_tokens, capacity, self.spec.page_size
        )
        record.max_new_tokens = max_new
        if max_new == 0 or spec.input_len + self.spec.page_size > capacity:
            record.status = "rejected"
            return
        prompt = prompt_tokens(spec, self.seed)
        self.prompts[spec.rid] = prompt
        if self.stop_lens and spec.output_len < max_new:
            self.stop_lens[spec.rid] = spec.input_len + spec.output_len
        start = max(spec.arrival, self.prefill_free_at)
        self.prefill_free_at = start + self.spec.cost.prefill_seconds([(0, spec.input_len)])
        room, self.next_room = self.next_room, self.next_room + 1
        self.hot.mem.ready[room] = self.prefill_free_at
        self.hot.mem.first_tokens[spec.rid] = next_token(prompt[-1], len(prompt) - 1)
        params = SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0, "seed": 0})
        req = Req(spec.rid, prompt, params, arrival_time=spec.arrival, bootstrap_room=room)
        self.hot.engine.submit(req)

    def emit(self, node: Node, req: Req, finished: bool) -> None:
        """A reply from ``node``'s engine, at its time."""
        record = self.records[req.rid]
        if not record.note_reply(req, finished, node.clock.now):
            return
        if self.spec.check_tokens and record.status == "finished":
            stop = self.stop_lens.get(req.rid, -1)
            want = expected_output(self.prompts[req.rid], record.max_new_tokens, stop)
            self.num_wrong_outputs += req.output_ids != want

    def _sample(self, seen: int) -> None:
        sizes, series = self.hot.mem.sizes, self.series
        series.t.append(self.hot.clock.now)
        series.used.append(self.hot.service.pool.capacity - sizes.available - sizes.evictable)
        series.evictable.append(sizes.evictable)
        series.context.append(sum(r.seq_len for r in self.hot.engine.running))
        series.ratio.append(self.hot.engine.ratio.current)
        series.waiting.append(len(self.hot.engine.prealloc) + len(self.hot.engine.retracted))
        series.running.append(len(self.hot.engine.running))
        for event in self.hot.mem.retracts[seen:]:
            series.retracts.append((event.time, len(event.retracted)))

    def totals(self) -> dict[str, Any]:
        hot, cold = self.hot.engine.stats, self.cold.engine.stats
        sim_s = max(self.hot.clock.now, self.cold.clock.now)
        return {
            **request_totals(list(self.records.values()), sim_s),
            "retractions": hot.retracted_reqs + cold.retracted_reqs,
            "retract_events": hot.retract_events + cold.retract_events,
            "reprefilled_tokens": hot.reprefilled_tokens + cold.reprefilled_tokens,
            "migrated_reqs": hot.migrated_out_reqs,
            "migrated_tokens": self.hot.mem.moved_tokens,
            "migrate_waited_steps": hot.migrate_waited_steps,
            "offloaded_tokens": self.hot.mem.offloaded_tokens + self.cold.mem.offloaded_tokens,
            "loaded_tokens": self.hot.mem.loaded_tokens + self.cold.mem.loaded_tokens,
            "copy_s": round(self.hot.clock.copy_s + self.cold.clock.copy_s, 6),
            "capacity": self.hot.service.pool.capacity,
            "peak_used": max(self.series.used, default=0),
            "peak_context": max(self.series.context, default=0),
            "peak_running": max(self.series.running, default=0),
            "unservable": 0,
            "wrong_outputs": self.num_wrong_outputs if self.spec.check_tokens else None,
        }


def run(spec: SimSpec, workload: list[RequestSpec], **kwargs: Any) -> SimResult:
    """One skewed run (blocking): :func:`run_async`'s."""
    return asyncio.run(run_async(spec, workload, **kwargs))


async def run_async(
    spec: SimSpec,
    workload: list[RequestSpec],
    *,
    migrate: bool,
    settings: dict[str, str] | None = None,
    seed: int = 0,
) -> SimResult:
    """The hot and the cold node serve ``workload``, the hot one moving its retracted
    requests to the cold one with ``migrate``; both pools end idle and intact."""
    if spec.is_hybrid:
        raise ValueError("--skew: a hybrid pool does not move requests yet")
    longest = max((r.input_len + r.max_new_tokens for r in workload), default=1)
    layout = tiny_layout(
        spec.pool_tokens, spec.page_size, spec.max_running_requests, longest + spec.page_size
    )
    host_tokens = spec.pool_tokens if spec.host_store_tokens is None else spec.host_store_tokens
    services: list[MemService] = []
    started = time.perf_counter()
    try:
        for _ in range(2):
            services.append(build_service(layout, host_store_tokens=host_tokens))
        pair = Pair(spec, workload, seed, migrate)
        await pair.run(services)
        for service in services:
            service.pool.check_integrity(idle=True)
        return SimResult(
            settings={**(settings or {}), "migrate": "on" if migrate else "off"},
            totals=pair.totals(),
            requests=list(pair.records.values()),
            series=pair.series,
            retract_log=[*pair.hot.mem.retracts, *pair.cold.mem.retracts],
            capacity=services[0].pool.capacity,
            wall_s=time.perf_counter() - started,
        )
    finally:
        for service in services:
            service.pool.close()
