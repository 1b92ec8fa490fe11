"""The PD prefill node's FIFO queue never blocks behind a prompt that can never fit (issue 18).

In process: the prefill engine over a real memsvc core, the fake model of the
engine tests, and a transfer that succeeds at once (the decode side is not
what is tested here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from memsvc.transfer import KVPoll
from scheduler_svc.core import Req, ReqState, SamplingParams, SchedulerConfig
from scheduler_svc.pd.prefill import PrefillEngine
from tests.helpers import small_layout
from tests.scheduler.engine_harness import FakeModel, InProcessMem

PAGE, NUM_PAGES = 4, 16  # a 64-token pool


class InstantTransfer(InProcessMem):
    """memsvc-P whose every send reaches the decode side at once."""

    async def pd_send(self, rid: str, room: int, *args, **kwargs) -> None:
        self.sent = [*getattr(self, "sent", []), rid]

    async def pd_status(self, rooms) -> list[dict]:
        return [{"room": r, "state": KVPoll.SUCCESS, "why": ""} for r in rooms]

    async def pd_forget(self, rooms) -> None:
        return None


@pytest.fixture
def service() -> Iterator[MemService]:
    layout = small_layout(page_size=PAGE, num_pages=NUM_PAGES, max_context_len=512)
    service = MemService(KVPool(layout), ServiceConfig(retract_decode_steps=20))
    yield service
    service.pool.close()


def _req(rid: str, prompt_len: int, room: int) -> Req:
    params = SamplingParams(max_new_tokens=1, draw={"temperature": 0.0}, ignore_eos=True)
    return Req(rid, [7] * prompt_len, params, bootstrap_room=room)


def test_a_prompt_that_cannot_fit_the_empty_pool_fails_alone(service) -> None:
    async def scenario() -> dict[str, Req]:
        done: dict[str, Req] = {}
        mem = await InstantTransfer.connect(service)
        capacity = service.pool.capacity
        engine = PrefillEngine(
            SchedulerConfig(page_size=PAGE, max_running_requests=8),
            mem,
            FakeModel(service.pool.table.array),
            lambda req, finished: done.update({req.rid: req}) if finished else None,
            capacity=capacity,
        )
        # Past intake (which rejects it on a real node) a prompt larger than the pool
        # reaches the queue; the short request behind it must not wait for ever.
        engine.submit(_req("too-big", capacity + 8, 1))
        engine.submit(_req("short", 9, 2))
        for _ in range(50):
            if not await engine.step() and engine.idle:
                break
        assert engine.idle, "the queue is stuck"
        await mem.check(idle=True)
        return done

    done = asyncio.run(scenario())
    big, short = done["too-big"], done["short"]
    assert big.state is ReqState.ABORTED and big.finish_reason.status_code == 400
    assert "cannot be admitted even into an empty pool" in big.finish_reason.message
    assert short.state is ReqState.FINISHED and short.output_ids
    service.pool.check_integrity(idle=True)
