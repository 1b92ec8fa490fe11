"""scheduler_svc.adopt in process: a scheduler dies mid-step, its successor adopts.

A real engine and memsvc core (:class:`InProcessMem`) with the fake model of the
engine tests (tokens depend on position and previous token only). The first
engine's step is stopped in the middle of its forward pass (its task is
cancelled: the memsvc side of the step, commit and reserved slots, went through,
the tokens did not) and the engine is never used again; a second engine, on a new
session, adopts the first one's session through ``Recovery.adopt_session`` (the
session id in a private file) and finishes every request with exactly
``expected_output``, computing no prefill token (its model's ``extend_tokens``
stays 0), and the pool is idle afterwards. Also: retracted-to-host requests are
loaded back, requests with no KV wait for their client, an adopted request no
client re-attaches to ends with an explicit error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from memsvc import protocol as wire
from memsvc.client import Call
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from model_svc.tokenizer import ByteTokenizer
from scheduler_svc import protocol as p
from scheduler_svc.adopt import Journal, Owner
from scheduler_svc.core import Req, ReqState, SamplingParams, SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.recovery import Recovery
from scheduler_svc.service import SchedulerService
from tests.helpers import small_layout
from tests.scheduler.engine_harness import FakeModel, InProcessMem, expected_output
from tests.scheduler.test_logprob_engine import LogprobModel, logprob_req

PAGE = 4
PROMPTS = {f"r{i}": [i + 1] * (5 + 3 * i) for i in range(5)}
MAX_NEW = 12


class Stalling:
    """A fake model's mixin: decode forward number ``stall_at`` never returns."""

    def __init__(self, table, stall_at: int | None = None) -> None:
        super().__init__(table)
        self.stall_at = stall_at
        self.decodes = 0

    async def decode(self, *args, **kwargs):
        self.decodes += 1
        if self.decodes == self.stall_at:
            await asyncio.Event().wait()  # the scheduler dies in here
        return await super().decode(*args, **kwargs)


class StallingModel(Stalling, FakeModel):
    """The fake model, stalling."""


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(
        page_size=PAGE, num_pages=64, max_running_requests=16, max_context_len=512
    )
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    try:
        yield MemService(pool, ServiceConfig(retract_decode_steps=20))
    finally:
        pool.close()


class Node:
    """One scheduler: engine, journal, recovery, on its own memsvc session."""

    def __init__(self, service: MemService, session_file: Path, journal: bool = True) -> None:
        self.service = service
        self.session_file = session_file
        self.with_journal = journal
        self.done: dict[str, Req] = {}

    async def start(
        self, stall_at: int | None = None, model: type[FakeModel] | None = None, **config
    ) -> Node:
        mem = await InProcessMem.connect(self.service)
        self.model = (model or StallingModel)(self.service.pool.table.array, stall_at)
        config = SchedulerConfig(**{"page_size": PAGE, "max_running_requests": 16, **config})
        self.engine = Engine(config, mem, self.model, self._emit, capacity=256)
        if self.with_journal:
            self.engine.journal = Journal(owner_of=lambda rid: Owner("client-1", "fp-" + rid, True))
        self.recovery = Recovery(
            self.engine,
            lambda: InProcessMem.connect(self.service),
            "inproc://memsvc",
            session_file=self.session_file,
        )
        await self.recovery.adopt_session()
        return self

    def _emit(self, req: Req, finished: bool) -> None:
        if finished:
            self.done[req.rid] = req

    def front(self) -> SchedulerService:
        """The service in front of this node's engine (its socket never bound): what a
        client's messages meet, and the adopted requests' waiters."""
        return SchedulerService(
            self.engine,
            "ipc:///nonexistent",
            tokenizer=ByteTokenizer(),
            capacity=256,
            page_size=PAGE,
            max_context_len=512,
            vocab_size=256,
            recovery=self.recovery,
        )

    def submit_all(self) -> None:
        for rid, prompt in PROMPTS.items():
            params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
            self.engine.submit(Req(rid, prompt, params))

    async def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not await self.engine.step() and self.engine.idle:
                return
        raise AssertionError("the engine did not go idle")

    async def die_in_step(self) -> None:
        """Step until a step's forward never returns (the ``stall_at``-th decode): that
        step is cancelled, as if the process died there."""
        for _ in range(200):
            task = asyncio.ensure_future(self.engine.step())
            for _ in range(50):
                await asyncio.sleep(0)
            if task.done():
                task.result()
                continue
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return
        raise AssertionError("no step got stuck")


async def successor(service: MemService, tmp_path: Path) -> Node:
    """A node that adopted a first one's session: the first died in its 4th decode step
    with every request of :data:`PROMPTS` submitted."""
    first = await Node(service, tmp_path / "session").start(stall_at=4)
    first.submit_all()
    await first.die_in_step()
    return await Node(service, tmp_path / "session").start()


def assert_exact(done: dict[str, Req]) -> None:
    assert set(done) == set(PROMPTS)
    for rid, prompt in PROMPTS.items():
        req = done[rid]
        assert req.state is ReqState.FINISHED, (rid, req.finish_reason)
        assert req.output_ids == expected_output(prompt, MAX_NEW), rid


async def goodbye(node: Node) -> None:
    await node.engine.mem._invoke(Call("goodbye", {}, None, lambda header, arrays: None))


@pytest.mark.parametrize("steps", [2, 5, 9])
def test_successor_decodes_on_from_the_kept_kv(service, tmp_path, steps) -> None:
    async def scenario() -> None:
        first = await Node(service, tmp_path / "session").start(stall_at=steps)
        first.submit_all()
        await first.die_in_step()
        before = {rid: list(r.output_ids) for rid, r in first.engine.reqs.items()}
        assert any(before.values())
        second = await Node(service, tmp_path / "session").start()
        stats = second.recovery.stats
        assert stats.adopted_reqs == len(PROMPTS)
        assert stats.reprefilled_tokens == 0
        assert stats.discarded_step_tokens > 0  # the slots of the step in flight
        assert (tmp_path / "session").read_text() == second.engine.mem.session
        await second.run()
        assert_exact(second.done)
        assert second.model.extend_tokens == 0, "the successor re-prefilled"
        await goodbye(second)
        service.pool.check_integrity(idle=True)
        assert len(service.sessions) == 0  # the first session (never closed) was adopted

    asyncio.run(scenario())


@pytest.mark.parametrize("stall_at, kinds", [(2, "parked"), (8, "from_host")])
def test_retracted_to_host_and_waiting_requests(service, tmp_path, stall_at, kinds) -> None:
    """Under pressure (retracts into the host store) and with requests still waiting:
    host entries are loaded back, no-KV requests wait for their client."""

    async def scenario() -> None:
        first = await Node(service, tmp_path / "session").start(
            stall_at=stall_at,
            retract_mode="offload",
            max_running_requests=3,
            test_retract=True,
            test_retract_interval=2,
        )
        first.submit_all()
        await first.die_in_step()
        second = await Node(service, tmp_path / "session").start()
        adopted = second.recovery.adopted
        assert adopted is not None and getattr(adopted, kinds), adopted
        assert second.recovery.stats.reprefilled_tokens == 0
        for req in list(adopted.parked.values()):  # their clients re-submit
            second.engine.submit(req)
        await second.run()
        assert_exact(second.done)
        await goodbye(second)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_unclaimed_adopted_requests_end_with_an_error(service, tmp_path) -> None:
    """No client re-attaches within the grace period: explicit error, KV released."""

    async def scenario() -> None:
        second = await successor(service, tmp_path)
        front = second.front()
        assert set(front._waiters) == set(PROMPTS)
        assert all(w.identity is None for w in front._waiters.values())
        front.reattach.since -= front.reattach.grace_s + 1
        front._expire_adopted()
        await second.run()
        assert not second.engine.reqs
        cached = [front._finished.get(rid) for rid in PROMPTS]
        assert all(c is not None for c in cached)  # each ended with its result cached
        assert front.reattach.expired == len(PROMPTS)
        await goodbye(second)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_adopted_requests_keep_their_sampling_and_stop_strings(service, tmp_path) -> None:
    async def scenario() -> None:
        first = await Node(service, tmp_path / "session").start(stall_at=3)
        params = SamplingParams(
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
            stop=("never-generated",),
            stop_token_ids=frozenset({9999}),
            draw={"temperature": 0.0, "seed": 7},
        )
        first.engine.submit(Req("s0", PROMPTS["r3"], params, priority=2, namespace="a" * 32))
        await first.die_in_step()
        second = await Node(service, tmp_path / "session").start()
        front = second.front()
        req = second.engine.reqs["s0"]
        assert req.sampling_params == params
        assert (req.priority, req.namespace) == (2, "a" * 32)
        assert req.stop_decoder == front._stop_decoder
        await second.run()
        assert req.state is ReqState.FINISHED  # (the service's _emit took the result)
        assert req.output_ids == expected_output(PROMPTS["r3"], MAX_NEW)
        await goodbye(second)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_a_refused_commit_turns_the_journal_off_and_serving_goes_on(service, tmp_path) -> None:
    """memsvc's record bound reached: no step fails, every request finishes exactly."""

    async def scenario() -> None:
        service.journals.max_records = 2
        node = await Node(service, tmp_path / "session").start()
        node.submit_all()
        await node.run()
        assert_exact(node.done)
        assert "record_limit" in node.engine.journal.disabled
        await goodbye(node)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


class StallingLogprobModel(Stalling, LogprobModel):
    """The logprob fake of tests.scheduler.test_logprob_engine, stalling."""


def logprob_state(req: Req) -> tuple:
    lp = req.logprob
    return (lp.input_vals, lp.input_tops, lp.input_done, lp.output_vals, lp.output_tops)


@pytest.mark.parametrize("stall_at", [2, 6])
def test_logprob_requests_are_adopted_with_their_logprobs(service, tmp_path, stall_at) -> None:
    """Issue 32's part 1 gap: a request that returns logprobs (its prompt's from some
    start, the top 2 of each token) is adopted like any other, and ends with exactly
    the logprobs of a run without the death; nothing is prefilled again."""

    def submit(node: Node) -> None:
        for i, (rid, prompt) in enumerate(PROMPTS.items()):
            start = [-1, 0, 2, len(prompt) - 1, 1][i]
            node.engine.submit(logprob_req(rid, prompt, MAX_NEW, start, top=2 * (i % 2)))

    async def scenario() -> None:
        reference = await Node(service, tmp_path / "ref", journal=False).start(
            model=StallingLogprobModel
        )
        submit(reference)
        await reference.run()
        want = {rid: logprob_state(req) for rid, req in reference.done.items()}
        await goodbye(reference)
        first = await Node(service, tmp_path / "session").start(
            stall_at=stall_at, model=StallingLogprobModel
        )
        submit(first)
        await first.die_in_step()
        second = await Node(service, tmp_path / "session").start(model=StallingLogprobModel)
        assert second.recovery.stats.adopted_reqs == len(PROMPTS)
        assert second.recovery.stats.reprefilled_tokens == 0
        await second.run()
        assert_exact(second.done)
        assert second.model.extend_tokens == 0, "the successor re-prefilled"
        for rid in PROMPTS:
            assert logprob_state(second.done[rid]) == want[rid], rid
        await goodbye(second)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_adopted_answers_only_for_the_owning_client(service, tmp_path) -> None:
    """``adopted`` (the PD router's question to a restarted decode node) names the rids
    adopted with their KV whose owner is the client asked with; a rid of another
    client, one adopted without KV or one never seen is not named, and a malformed
    query is refused. Nothing changes."""

    async def scenario() -> None:
        second = await successor(service, tmp_path)
        front = second.front()
        with_kv = set(PROMPTS) - set(front.reattach.adopted.parked)
        assert with_kv, "the first node died holding no KV"
        rids = [*PROMPTS, "never-seen"]
        clients = ["client-1"] * len(rids)
        clients[0] = "client-2"  # r0 is client-1's: another client asking learns nothing
        query = {"op": "adopted", "op_id": 7, "rids": rids, "clients": clients}
        reply = wire.unpack(front._accept(b"router", p.parse_request(wire.pack(query))))
        assert reply["ok"] and reply["op_id"] == 7
        assert set(reply["rids"]) == with_kv - {"r0"}
        with pytest.raises(wire.ProtocolError, match="same length"):
            p.parse_request(wire.pack({**query, "clients": clients[:-1]}))
        assert set(front._waiters) == set(PROMPTS)  # asking attached nothing
        assert all(w.identity is None for w in front._waiters.values())
        for rid in PROMPTS:
            front.engine.abort(rid)
        await second.run()
        await goodbye(second)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())
