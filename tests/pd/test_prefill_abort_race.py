"""An abort that reaches the prefill node while its KV is on the wire keeps the prefix cache.

The router aborts what a flight leaves on the prefill node when the decode side
ends. With one output token the decode side can end before memsvc-P has the
decode side's ack, so the abort used to find the request still in flight and
free its KV unpublished: the next request with that prompt missed the prefill
node's prefix cache (``cached_tokens`` 0, seen in about 1 PD run of 3 of
tests/http/test_tenancy_smollm2.py). A transfer that succeeds, before or after
the abort, now publishes the KV; one that fails, or never started, is freed.

In process: the prefill engine over a real memsvc core, the fake model of the
engine tests, and a transfer whose state the test sets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from memsvc.protocol import unpack
from memsvc.transfer import KVPoll
from model_svc.tokenizer import ByteTokenizer
from scheduler_svc.core import Req, ReqState, SamplingParams, SchedulerConfig
from scheduler_svc.pd.prefill import PrefillEngine
from scheduler_svc.service import SchedulerService
from tests.helpers import small_layout
from tests.pd.test_prefill_queue import NUM_PAGES, InstantTransfer
from tests.scheduler.engine_harness import FakeModel

PAGE = 4  # a 64-token pool, as tests/pd/test_prefill_queue.py's
PROMPT = 17  # four whole pages cached after the transfer
PARAMS = SamplingParams(max_new_tokens=1, draw={"temperature": 0.0}, ignore_eos=True)


class HeldTransfer(InstantTransfer):
    """memsvc-P whose rooms stay in the state the test last set."""

    state = KVPoll.TRANSFERRING

    async def pd_status(self, rooms) -> list[dict]:
        return [{"room": r, "state": self.state, "why": "test"} for r in rooms]


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=PAGE, num_pages=NUM_PAGES, max_context_len=512)
    service = MemService(KVPool(layout), ServiceConfig())
    yield service
    service.pool.close()


def _engine(service: MemService, mem: HeldTransfer, ended: dict[str, Req]) -> PrefillEngine:
    return PrefillEngine(
        SchedulerConfig(page_size=PAGE, max_running_requests=8),
        mem,
        FakeModel(service.pool.table.array),
        lambda req, finished: ended.update({req.rid: req}) if finished else None,
        capacity=service.pool.capacity,
    )


async def _in_flight(engine: PrefillEngine, rid: str = "r", room: int = 7) -> None:
    """``rid`` prefilled and its KV sent under ``room``."""
    engine.submit(Req(rid, list(range(1, PROMPT + 1)), PARAMS, bootstrap_room=room))
    for _ in range(20):
        await engine.step()
        if room in engine.inflight:
            return
    raise AssertionError(f"{rid} never reached its transfer")


def _front(service: MemService, engine: PrefillEngine) -> SchedulerService:
    """The scheduler service around ``engine`` (its flush path; no socket is opened)."""
    return SchedulerService(
        engine,
        "ipc:///nonexistent/kvstack-flush-settle.sock",
        tokenizer=ByteTokenizer(),
        capacity=service.pool.capacity,
        page_size=PAGE,
        max_context_len=512,
        vocab_size=256,
    )


def _run(service: MemService, settle_before: KVPoll, settle_after: KVPoll | None):
    """Prefill one request, abort it in flight with its room ``settle_before``, then
    (if given) settle the room as ``settle_after``; the request's end and the tokens
    cached on the device."""

    async def scenario() -> tuple[Req, int]:
        ended: dict[str, Req] = {}
        mem = await HeldTransfer.connect(service)
        engine = _engine(service, mem, ended)
        await _in_flight(engine)
        mem.state = settle_before
        assert engine.abort("r", "the decode side ended", 499)
        await engine.step()
        if settle_after is not None:
            mem.state = settle_after
            for _ in range(20):
                if engine.idle:
                    break
                await engine.step()
        assert engine.idle, f"the request is still held: {engine.inflight}"
        await mem.check(idle=True)
        return ended["r"], service.pool.evictable_size()

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    "before, after",
    [(KVPoll.SUCCESS, None), (KVPoll.TRANSFERRING, KVPoll.SUCCESS)],
    ids=["acked-before-the-abort", "acked-after-the-abort"],
)
def test_a_sent_request_is_cached_despite_the_abort(service, before, after) -> None:
    req, cached = _run(service, before, after)
    assert req.state is ReqState.FINISHED, req.finish_reason
    assert cached == PROMPT // PAGE * PAGE, f"{cached} tokens cached, the prompt not published"
    service.pool.check_integrity(idle=True)


@pytest.mark.parametrize(
    "before, after",
    [(KVPoll.BOOTSTRAPPING, None), (KVPoll.TRANSFERRING, KVPoll.FAILED)],
    ids=["not-sent", "failed-after-the-abort"],
)
def test_an_unsent_request_is_freed(service, before, after) -> None:
    req, cached = _run(service, before, after)
    assert req.state is ReqState.ABORTED
    assert cached == 0, f"{cached} tokens of an unsent request cached"
    service.pool.check_integrity(idle=True)


def test_a_flush_right_after_the_abort_waits_for_the_transfer(service) -> None:
    """The router aborts the prefill side, then answers the client, who flushes at once:
    the prefill node, its transfer still waiting for the ack, must not refuse the flush
    (it did, "pending requests", in about 1 of 2 PD runs with one torch thread)."""

    async def scenario() -> dict:
        mem = await HeldTransfer.connect(service)
        engine = _engine(service, mem, {})
        front = _front(service, engine)
        await _in_flight(engine)
        assert engine.abort("r", "the decode side ended", 499)
        front._flushes.append((b"client", 1, None, time.monotonic()))
        await front._flush_cache()
        assert front._flushes, "a flush answered while a transfer was about to settle"
        assert front._outbox.empty()
        mem.state = KVPoll.SUCCESS  # the ack arrives
        for _ in range(20):
            await engine.step()
            await front._flush_cache()
            if not front._flushes:
                break
        _, *frames = front._outbox.get_nowait()
        await mem.check(idle=True)
        return unpack(frames)

    reply = asyncio.run(scenario())
    assert reply["flushed"], reply
    assert service.pool.evictable_size() == 0  # the published prompt, flushed
    service.pool.check_integrity(idle=True)


def test_a_flush_meeting_running_work_is_refused_at_once(service) -> None:
    """Settling is for work that ends by itself: a queued request is refused as before."""

    async def scenario() -> bool:
        mem = await HeldTransfer.connect(service)
        engine = _engine(service, mem, {})
        front = _front(service, engine)
        await _in_flight(engine)
        engine.submit(Req("q", list(range(1, PROMPT + 1)), PARAMS, bootstrap_room=8))
        await engine._apply_commands()  # queued
        front._flushes.append((b"client", 1, None, time.monotonic()))
        await front._flush_cache()
        refused = not front._flushes and not front._outbox.empty()
        mem.state = KVPoll.SUCCESS  # both are sent and end
        for _ in range(20):
            if engine.idle:
                break
            await engine.step()
        await mem.check(idle=True)
        return refused

    assert asyncio.run(scenario()), "a flush with a queued request was not answered at once"
    service.pool.check_integrity(idle=True)
