"""One admission round in two memsvc round trips (issue 28, item 2).

The engine's round (one ``admit``, one ``alloc_extend`` that also closes the
candidates not admitted, one ``cache_unfinished_many``) is compared with the
round as it was before: a ``heartbeat`` with nothing running, then
``alloc_row`` and ``match_prefix`` per candidate and ``free_row`` for the one
refused (:class:`PerRequestEngine`, kept here as the reference). The same
requests are admitted in the same rounds with the same prefixes, and the
tokens are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from memsvc.core import KVPool
from memsvc.core.errors import OutOfRowsError
from memsvc.handlers import MemService, ServiceConfig
from scheduler_svc.core import (
    AddResult,
    PrefillAdder,
    Req,
    ReqState,
)
from scheduler_svc.engine import Engine
from tests.helpers import small_layout
from tests.scheduler.engine_harness import FakeModel, InProcessMem, expected_output
from tests.scheduler.test_engine import Harness, run
from tests.scheduler.test_hicache_engine import hicache_service


class CountingMem(InProcessMem):
    """Counts the memsvc ops (round trips) by name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops: dict[str, int] = {}

    def observe(self, op: str, fields: dict[str, Any], result: Any) -> None:
        self.ops[op] = self.ops.get(op, 0) + 1


class PerRequestEngine(Engine):
    """The admission round before issue 28, one request at a time (the reference)."""

    def _candidates(self, adder: PrefillAdder, hits: int | None = None) -> tuple[list[Req], bool]:
        return [], False  # no admit: with nothing running, the round starts with a heartbeat

    async def _admit_waiting(self, adder: PrefillAdder, first: Any = None) -> Any:
        assert first is None
        started: list[Req] = []
        num_resumed = 0
        while self.waiting and adder.could_admit(self.waiting[0]):
            req = self.waiting[0]
            assert not req.host_copy  # these workloads retract by freeing
            try:
                row = await self.mem.alloc_row(req.rid)
            except OutOfRowsError:
                break
            before = self.mem.sizes
            match = await self.mem.match_prefix_tiers(req.rid, req.fill_ids[: req.max_prefix_len])
            pinned = before.evictable - self.mem.sizes.evictable
            if self.hierarchical:
                pinned += before.available - self.mem.sizes.available
            adder.lock_prefix(min(max(pinned, 0), match.prefix_len, adder.available_tokens))
            decision = adder.add_one_req(req, match.prefix_len)
            if not decision.admitted:
                await self.mem.free_row(req.rid)
                break
            req.start_prefill(row, match.prefix_len, decision.extend_len)
            self.waiting.popleft()
            started.append(req)
            if decision.result is not AddResult.CONTINUE:
                break
        return started, num_resumed, []


class Stack(Harness):
    """The engine tests' harness with an engine of ``engine_cls``, counting memsvc ops
    and recording each extend batch as (rid, prefix length, extend length)."""

    def __init__(self, service: MemService, engine_cls: type[Engine], **config: Any) -> None:
        super().__init__(service, **config)
        self.engine_cls = engine_cls
        self.rounds: list[list[tuple[str, int, int]]] = []

    async def start(self) -> Stack:
        self.mem = await CountingMem.connect(self.service)
        self.model = FakeModel(self.service.pool.table.array)
        extend = self.model.extend

        async def recording_extend(items, **kwargs):
            rows = {r.row: r for r in self.engine.reqs.values()}
            self.rounds.append([(rows[row].rid, p, len(new)) for row, p, new in items])
            return await extend(items, **kwargs)

        self.model.extend = recording_extend
        self.engine = self.engine_cls(
            self.config, self.mem, self.model, self._emit, capacity=self.service.pool.capacity
        )
        return self


@pytest.fixture
def big_service() -> Iterator[MemService]:
    """Room for 64 prompts of 2k tokens at page size 16."""
    layout = small_layout(
        page_size=16, num_pages=8704, max_running_requests=64, max_context_len=4096
    )
    pool = KVPool(layout)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


PROMPTS_64 = {f"p{i}": [1 + i % 7, *range(10 * i, 10 * i + 2047)] for i in range(64)}


def first_round_ops(service: MemService, engine_cls: type[Engine]) -> tuple[dict, Stack]:
    async def scenario() -> tuple[dict, Stack]:
        stack = await Stack(
            service, engine_cls, max_running_requests=64, max_prefill_tokens=1 << 18
        ).start()
        for rid, prompt in PROMPTS_64.items():
            stack.submit(rid, prompt, 4)
        await stack.engine.step()
        ops = dict(stack.mem.ops)
        assert all(r.state is ReqState.RUNNING for r in stack.engine.reqs.values())
        assert len(stack.engine.running) == 64
        await stack.run()
        for rid, prompt in PROMPTS_64.items():
            assert stack.done[rid].output_ids == expected_output(prompt, 4), rid
        service.pool.check_integrity(idle=True)
        return ops, stack

    return run(scenario())


def test_sixty_four_prompts_are_admitted_in_three_round_trips(big_service) -> None:
    ops, stack = first_round_ops(big_service, Engine)
    ops.pop("hello", None)
    assert ops == {"admit": 1, "alloc_extend": 1, "cache_unfinished_many": 1}, ops
    assert [len(r) for r in stack.rounds[:1]] == [64]


def test_the_per_request_round_took_a_round_trip_per_request(big_service) -> None:
    ops, _ = first_round_ops(big_service, PerRequestEngine)
    ops.pop("hello", None)
    assert ops == {
        "heartbeat": 1,
        "alloc_row": 64,
        "match_prefix": 64,
        "alloc_extend": 1,
        "cache_unfinished_many": 1,
    }, ops


def workload() -> dict[str, tuple[list[int], int]]:
    """Shared system prompts, retracted re-prefills, a pool too small for all at once."""
    system = [list(range(500, 532)), list(range(700, 728))]
    out = {}
    for i in range(14):
        tail = [1000 + 37 * i + k for k in range(3 + (5 * i) % 11)]
        out[f"r{i}"] = (system[i % 2] + tail, 6 + (7 * i) % 13)
    return out


@pytest.mark.parametrize(("chunked", "hierarchical"), [(None, False), (16, False), (None, True)])
def test_rounds_admit_what_the_per_request_rounds_admitted(
    chunked: int | None, hierarchical: bool
) -> None:
    """Under budget and retract pressure, with shared prefixes (and with the hierarchy:
    host hits loaded back): every extend batch (rid, prefix, extend length) and every
    output are the reference's. The load cost model is off: the reference's
    per-request match sends no prefill rate, the engine's admit does (and with the fake
    model's instant prefill every load would be skipped as dearer than recomputing)."""
    results = []
    for engine_cls in (PerRequestEngine, Engine):
        with hicache_service(40, hierarchical=hierarchical, load_cost_model=False) as service:

            async def scenario(service=service, engine_cls=engine_cls) -> Stack:
                stack = await Stack(
                    service,
                    engine_cls,
                    chunked_prefill_size=chunked,
                    max_running_requests=6,
                    test_retract=True,
                    test_retract_interval=3,
                ).start()
                for rid, (prompt, max_new) in workload().items():
                    stack.submit(rid, prompt, max_new)
                await stack.run()
                if hierarchical:  # again, each prompt's cached part now on the host
                    await stack.mem.flush_cache(device_only=True)
                    for rid, (prompt, max_new) in workload().items():
                        stack.submit(f"{rid}-again", prompt, max_new)
                    await stack.run()
                    stack.hits = service.pool.hicache.stats_dict()["hit_tokens"]
                service.pool.check_integrity(idle=True)
                return stack

            results.append(run(scenario()))
    reference, batched = results
    assert reference.engine.stats.retracted_reqs > 0, "meant to retract"
    assert max(len(r) for r in reference.rounds) > 1, "meant to admit several per round"
    if hierarchical:  # memsvc's count of the tokens each tier's matches hit
        assert reference.hits["host"] > 0, "meant to load from the host"
        assert batched.hits == reference.hits
    assert batched.rounds == reference.rounds
    assert batched.done.keys() == reference.done.keys()
    for rid, req in batched.done.items():
        prompt, max_new = workload()[rid.removesuffix("-again")]
        assert req.output_ids == expected_output(prompt, max_new), rid
        assert req.output_ids == reference.done[rid].output_ids
    assert batched.mem.ops.get("alloc_row", 0) == 0
    assert batched.mem.ops.get("match_prefix", 0) == 0
