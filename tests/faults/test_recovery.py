"""scheduler_svc.recovery on a real engine and memsvc core (in process), deterministically.

The engine runs against :class:`InProcessMem` and the fake model of the
engine tests (tokens depend only on position and previous token), so a
request re-prefilled after a fault must still produce exactly
``expected_output``; what is checked is the repair of the engine's queues.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from memsvc.client import EpochChangedError
from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from memsvc.ops import _Call, _nothing
from memsvc.sessions import NotOwnerError
from model_svc.client import ForwardError
from scheduler_svc.core import Req, ReqState, SamplingParams, SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.pd.decode import DecodeEngine
from scheduler_svc.pd.prefill import PrefillEngine
from scheduler_svc.recovery import Recovery, RecoveryFailedError
from tests.helpers import small_layout
from tests.scheduler.engine_harness import FakeModel, InProcessMem, expected_output

PAGE = 4


def new_service() -> MemService:
    layout = small_layout(
        page_size=PAGE, num_pages=64, max_running_requests=16, max_context_len=512
    )
    return MemService(KVPool(layout), ServiceConfig(retract_decode_steps=20))


@pytest.fixture
def services() -> Iterator[list[MemService]]:
    made: list[MemService] = []
    yield made
    for service in made:
        service.pool.close()


class Rig:
    """An engine whose failed steps go through :class:`Recovery`, as in the service loop."""

    def __init__(self, service: MemService, **recovery_kwargs) -> None:
        self.service = service
        self.done: dict[str, Req] = {}
        self.recovery_kwargs = recovery_kwargs
        self.failures: list[BaseException] = []

    async def start(self) -> Rig:
        mem = await InProcessMem.connect(self.service)
        self.model = FakeModel(self.service.pool.table.array)
        config = SchedulerConfig(page_size=PAGE, max_running_requests=16)
        self.engine = Engine(config, mem, self.model, self._emit, capacity=512)
        self.recovery = Recovery(
            self.engine,
            lambda: InProcessMem.connect(self.service),
            "inproc://memsvc",
            **self.recovery_kwargs,
        )
        return self

    def _emit(self, req: Req, finished: bool) -> None:
        if finished:
            self.done[req.rid] = req

    def submit(self, rid: str, prompt: list[int], max_new: int = 10) -> None:
        params = SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0}, ignore_eos=True)
        self.engine.submit(Req(rid, prompt, params))

    async def step(self) -> bool:
        try:
            did = await self.engine.step()
            self.recovery.step_succeeded()
            return did
        except Exception as exc:
            self.failures.append(exc)
            await self.recovery.recover(exc)
            return True

    async def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not await self.step() and self.engine.idle:
                return
        raise AssertionError("the engine did not go idle")


PROMPTS = {f"r{i}": [i + 1] * (5 + 3 * i) for i in range(5)}


def assert_right_tokens(rig: Rig) -> None:
    assert set(rig.done) == set(PROMPTS)
    for rid, prompt in PROMPTS.items():
        req = rig.done[rid]
        assert req.state is ReqState.FINISHED, (rid, req.finish_reason)
        assert req.output_ids == expected_output(prompt, 10), rid


def test_memsvc_restart_requeues_every_kv_holder(services) -> None:
    """memsvc comes back empty with a new epoch: running and prefilling requests re-prefill."""

    async def scenario() -> None:
        first = new_service()
        services.append(first)
        rig = await Rig(first).start()
        for rid, prompt in PROMPTS.items():
            rig.submit(rid, prompt)
        for _ in range(4):  # prefill and a few decode steps
            await rig.step()
        holders = [r.rid for r in rig.engine.reqs.values() if r.row is not None]
        assert holders, "some requests should hold KV by now"
        # memsvc "restarts": a new pool and epoch behind the same address
        second = new_service()
        services.append(second)
        rig.engine.mem._service = second
        rig.service = second
        rig.model.table = second.pool.table.array
        await rig.run()
        assert isinstance(rig.failures[0], EpochChangedError)
        assert rig.recovery.stats.memsvc_resets == 1
        assert rig.recovery.stats.requeued_reqs == len(holders)
        assert_right_tokens(rig)
        for rid in holders:
            assert rig.done[rid].retraction_count >= 1
        second.pool.check_integrity(idle=False)
        await rig.engine.mem._invoke(_Call("goodbye", {}, None, _nothing))
        second.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_rid_held_by_a_dead_session_waits_then_proceeds(services) -> None:
    """A predecessor's session still owns a rid: the half-built batch is undone, then retried."""

    async def scenario() -> None:
        service = new_service()
        services.append(service)
        rig = await Rig(service).start()
        ghost = await InProcessMem.connect(service, name="ghost")
        await ghost.alloc_row("r2")
        for rid, prompt in PROMPTS.items():
            rig.submit(rid, prompt)
        await rig.step()
        assert isinstance(rig.failures[-1], NotOwnerError)
        assert rig.recovery.stats.rolled_back_reqs == 2  # r0 and r1 were in the batch
        assert [r.rid for r in rig.engine.waiting][:3] == ["r0", "r1", "r2"]
        assert all(r.row is None for r in rig.engine.waiting)
        service.pool.check_integrity()
        await ghost._invoke(_Call("goodbye", {}, None, _nothing))  # the lease ran out
        await rig.run()
        assert_right_tokens(rig)
        await rig.engine.mem._invoke(_Call("goodbye", {}, None, _nothing))
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_rid_held_too_long_ends_with_an_explicit_error(services) -> None:
    async def scenario() -> None:
        service = new_service()
        services.append(service)
        rig = await Rig(service, recovery_timeout_s=0.0).start()
        ghost = await InProcessMem.connect(service, name="ghost")
        await ghost.alloc_row("r0")
        rig.submit("r0", PROMPTS["r0"])
        await rig.step()  # seen first
        await asyncio.sleep(0.01)
        await rig.step()  # still held past the timeout: aborted
        req = rig.done["r0"]
        assert req.state is ReqState.ABORTED
        assert req.finish_reason.status_code == 409
        assert "held by another memsvc session" in req.finish_reason.message
        assert rig.engine.idle

    asyncio.run(scenario())


def test_refused_batch_after_the_session_expired_is_a_lost_session(services) -> None:
    """A stalled scheduler's session expired: model_svc refuses rows without KV first."""

    async def scenario() -> None:
        service = new_service()
        services.append(service)
        rig = await Rig(service).start()
        for rid, prompt in PROMPTS.items():
            rig.submit(rid, prompt)
        for _ in range(3):
            await rig.step()
        await rig.engine.mem._invoke(_Call("goodbye", {}, None, _nothing))  # "expired"
        await rig.recovery.recover(ForwardError("invalid_batch", "positions without a KV slot"))
        assert rig.recovery.stats.memsvc_resets == 1
        assert rig.recovery.stats.requeued_reqs > 0
        await rig.run()
        assert_right_tokens(rig)

    asyncio.run(scenario())


def test_a_fault_it_cannot_repair_is_reported(services) -> None:
    async def scenario() -> None:
        service = new_service()
        services.append(service)
        rig = await Rig(service).start()
        with pytest.raises(RecoveryFailedError, match="ValueError: boom"):
            await rig.recovery.recover(ValueError("boom"))
        # a refused batch while memsvc still knows our session is a real error
        with pytest.raises(RecoveryFailedError, match="invalid_batch"):
            await rig.recovery.recover(ForwardError("invalid_batch", "invalid_batch: bad rows"))

    asyncio.run(scenario())


# -- PD engines: what losing the KV means for their queues -------------------------------


class _NoMem:
    """Enough of a memsvc client to build a PD engine; the recovery hooks make no calls."""

    layout = None


def _pd_engine(cls):
    done: list[Req] = []
    engine = cls(
        SchedulerConfig(page_size=PAGE, max_running_requests=16),
        _NoMem(),
        None,
        lambda req, finished: done.append(req) if finished else None,
    )
    rebootstraps: list[tuple[str, int, list[int]]] = []
    engine.on_rebootstrap = lambda req, room, ids: rebootstraps.append((req.rid, room, ids))
    return engine, done, rebootstraps


def _pd_req(engine, rid: str, prompt: list[int], room: int, max_new: int = 10) -> Req:
    params = SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0}, ignore_eos=True)
    req = Req(rid, prompt, params, bootstrap_room=room)
    engine.reqs[rid] = req
    return req


def test_decode_engine_rebootstraps_every_kv_holder() -> None:
    """memsvc-D lost the KV: running, host-retracted, awaiting-transfer requests and the
    head of the preallocation queue go back through the prefill node under fresh rooms."""
    engine, done, rebootstraps = _pd_engine(DecodeEngine)
    running = _pd_req(engine, "run", [1, 2, 3], 1)
    running.commit_transfer(0, 7)
    running.append_token(8)
    engine.running.append(running)
    parked = _pd_req(engine, "parked", [4, 5], 2)
    parked.commit_transfer(1, 9)
    parked.reset_for_retract()
    parked.host_copy = True
    engine.retracted.append(parked)
    moving = _pd_req(engine, "moving", [6, 6, 6], 3)
    engine.transfer[3] = moving
    engine._rows["moving"] = 2
    head, tail = _pd_req(engine, "head", [1], 4), _pd_req(engine, "tail", [2], 5)
    engine.prealloc.extend([head, tail])
    finished = _pd_req(engine, "finished", [3], 6, max_new=1)
    finished.commit_transfer(3, 1)
    assert finished.check_finished()  # finished in the failed step, not reported yet

    lost = engine.requeue_kv_holders("EpochChangedError: test")

    assert [r.rid for r in lost] == ["run", "parked", "moving", "head"]
    assert [r.rid for r in engine.prealloc] == ["run", "parked", "moving", "head", "tail"]
    assert not (engine.running or engine.retracted or engine.transfer or engine._rows)
    assert [r.rid for r in done] == ["finished"] and "finished" not in engine.reqs
    by_rid = {rid: (room, ids) for rid, room, ids in rebootstraps}
    assert by_rid["run"][1] == [1, 2, 3, 7]  # all but the last token: resumed, not committed
    assert by_rid["parked"][1] == [4, 5]
    assert by_rid["moving"][1] == [6, 6, 6] and by_rid["head"][1] == [1]  # prompt only
    assert running.is_retracted and not parked.host_copy and tail.bootstrap_room == 5
    rooms = [room for room, _ in by_rid.values()]
    assert len(set(rooms)) == 4 and all(room >= 1 << 62 for room in rooms)
    assert all(by_rid[r.rid][0] == r.bootstrap_room for r in lost)
    assert engine.stats.rebootstraps == 4


def test_prefill_engine_prefills_every_kv_holder_again() -> None:
    """memsvc-P lost the KV: a request being sent starts over (same rid, same room), a
    half-prefilled one is re-prefilled, both ahead of the requests that never started."""
    engine, done, _ = _pd_engine(PrefillEngine)
    sending = _pd_req(engine, "sending", [1, 2, 3], 11)
    sending.start_prefill(0, 0, 3)
    sending.complete_extend()
    sending.append_token(5)
    engine.inflight[11] = sending
    chunk = _pd_req(engine, "chunk", [4] * 8, 12)
    chunk.start_prefill(1, 0, 4)
    engine.chunked = chunk
    waiting = _pd_req(engine, "waiting", [7], 13)
    engine.waiting.append(waiting)

    requeued = engine.requeue_kv_holders("PeerDeadError: test")

    assert [r.rid for r in requeued] == ["sending", "chunk"]
    assert [r.rid for r in engine.waiting] == ["sending", "chunk", "waiting"]
    fresh = engine.reqs["sending"]
    assert fresh is not sending and fresh.state is ReqState.WAITING and not fresh.output_ids
    assert fresh.bootstrap_room == 11 and fresh.fill_ids == [1, 2, 3]
    assert chunk.is_retracted and engine.chunked is None and not engine.inflight
    assert not done
