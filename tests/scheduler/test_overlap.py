"""The overlap schedule (issue 28, item 3): memsvc reserves step t+1 while step t runs.

With the in-process memsvc and the deterministic fake model: the tokens are
the same with the overlap on and off, under retract pressure, in normal and
PD mode; the reservation is sent while the forward pass is in flight and
saves the next round its ``decode_step``; a request that finishes holds no
reserved slot past its step; and a round short of room gives the reserved
slots back before it retracts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from scheduler_svc.core import SamplingParams
from tests.helpers import pool_service
from tests.pd.decode_harness import DecodeNode
from tests.scheduler.engine_harness import InProcessMem, expected_output
from tests.scheduler.test_engine import Harness, run


class CountingMem(InProcessMem):
    """Counts memsvc ops by name, and the ones sent while a forward pass is in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ops: dict[str, int] = {}
        self.during_forward: list[str] = []
        self.forward_in_flight = False

    def observe(self, op: str, fields: dict[str, Any], result: Any) -> None:
        self.ops[op] = self.ops.get(op, 0) + 1
        if self.forward_in_flight:
            self.during_forward.append(op)


class SlowModel:
    """Wraps the fake model: its decode yields to the event loop before answering, as a
    forward pass on another process does, and tells ``mem`` while it is in flight."""

    def __init__(self, model: Any, mem: CountingMem) -> None:
        self._model, self._mem = model, mem

    async def extend(self, *args: Any, **kwargs: Any) -> Any:
        return await self._model.extend(*args, **kwargs)

    async def decode(self, *args: Any, **kwargs: Any) -> Any:
        self._mem.forward_in_flight = True
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            return await self._model.decode(*args, **kwargs)
        finally:
            self._mem.forward_in_flight = False


async def counted(service, **config: Any) -> Harness:
    h = await Harness(service, **config).start()
    mem = await CountingMem.connect(service)
    h.engine.mem = mem
    h.engine.model = SlowModel(h.model, mem)
    return h


PROMPTS = {f"r{i}": [i + 1] * (5 + 3 * i) for i in range(8)}


@pytest.mark.parametrize("overlap", [True, False])
def test_tokens_are_the_same_with_the_overlap_on_and_off_under_retract_pressure(
    overlap: bool,
) -> None:
    """A pool too small for all eight requests at once: rounds run out of room, retract
    (kv full) and re-admit. Every output is the no-pressure one either way."""
    with pool_service(page_size=4, num_pages=32) as service:

        async def scenario() -> None:
            h = await counted(service, disable_overlap_schedule=not overlap)
            for rid, prompt in PROMPTS.items():
                h.submit(rid, prompt, 40)
            await h.run()
            stats = h.engine.stats
            assert stats.retracted_reqs > 0, "the pool was meant to force retracts"
            for rid, prompt in PROMPTS.items():
                assert h.done[rid].output_ids == expected_output(prompt, 40), rid
            if overlap:
                assert stats.reserved_ahead_steps > 0
            else:
                assert stats.reserved_ahead_steps == stats.dropped_ahead_reqs == 0
                assert "decode_step" not in h.engine.mem.during_forward
            service.pool.check_integrity(idle=True)

        run(scenario())


def test_the_reservation_is_sent_during_the_forward_and_saves_the_next_decode_step() -> None:
    with pool_service(page_size=4, num_pages=256) as service:

        async def scenario() -> None:
            h = await counted(service)
            for rid, prompt in list(PROMPTS.items())[:4]:
                h.submit(rid, prompt, 16)
            await h.run()
            mem, stats = h.engine.mem, h.engine.stats
            decode_passes = stats.forward_passes - 1  # one prefill round admitted all four
            assert mem.during_forward.count("decode_step") == stats.reserved_ahead_steps
            # Each decode round but the first found its slots reserved: one decode_step
            # per round (the one ahead, none before), not two.
            assert stats.reserved_ahead_steps == decode_passes - 1
            assert mem.ops["decode_step"] == decode_passes
            service.pool.check_integrity(idle=True)

        run(scenario())


def test_a_request_that_finishes_holds_no_reserved_slot_past_its_step() -> None:
    """``short`` stops on a token (not by length: its slot for the next step is reserved
    while it runs); after that step memsvc no longer has it open, and the pages it held
    but the tree keeps are free."""
    with pool_service(page_size=1, num_pages=256) as service:

        async def scenario() -> None:
            h = await counted(service)
            prompt = [3] * 6
            stop_at = expected_output(prompt, 8)[4]
            short = h.submit("short", prompt, 8)
            short.sampling_params = SamplingParams(
                max_new_tokens=8, stop_token_ids={stop_at}, draw={"temperature": 0.0}
            )
            h.submit("long", [4] * 6, 16)
            for _ in range(100):
                await h.engine.step()
                if "short" in h.done:
                    break
            assert h.done["short"].output_ids[-1] == stop_at
            assert h.engine.stats.reserved_ahead_steps > 0
            assert not service.pool.is_open("short")
            (running,) = h.engine.running
            assert running.slot_reserved
            pool = service.pool
            held = pool.request("long").kv_len
            assert held == running.kv_len + 1  # its slot for the next step, reserved
            tree = 6 + 4  # short's prompt and written outputs, cached
            assert pool.available_size() == pool.capacity - held - tree
            pool.check_integrity()
            await h.run()
            assert h.done["long"].output_ids == expected_output([4] * 6, 16)
            pool.check_integrity(idle=True)

        run(scenario())


def test_a_round_short_of_room_gives_the_reserved_slots_back_before_it_retracts() -> None:
    """``a`` runs with its next slot reserved; ``b`` is admitted and prefilled; then
    another session takes every free slot. The decode round cannot reserve ``b``'s slot:
    it gives ``a``'s back (one slot: page size 1), and with both needing one and one
    free, it retracts ``b``. Both still produce their no-pressure tokens."""
    with pool_service(page_size=1, num_pages=128) as service:

        async def scenario() -> None:
            h = await counted(service)
            a = h.submit("a", [3] * 6, 12)
            for _ in range(3):
                await h.engine.step()
            assert a.slot_reserved
            b = h.submit("b", [4] * 6, 12)
            await h.engine.step()  # the prefill round: b joins the running batch
            assert b in h.engine.running and not b.slot_reserved
            hog = await InProcessMem.connect(service, name="hog")
            await hog.alloc_row("hog")
            assert (await hog.alloc_extend([("hog", hog.sizes.available)])).fits
            assert service.pool.evictable_size() == 0
            await h.engine.step()
            stats = h.engine.stats
            assert stats.dropped_ahead_reqs == 1
            assert stats.retracted_reqs == 1 and b.is_retracted
            await hog.free_row("hog")
            await h.run()
            assert h.done["a"].output_ids == expected_output([3] * 6, 12)
            assert h.done["b"].output_ids == expected_output([4] * 6, 12)
            service.pool.check_integrity(idle=True)

        run(scenario())


@pytest.mark.parametrize("overlap", [True, False])
def test_pd_decode_tokens_are_the_same_with_the_overlap_on_and_off(overlap: bool) -> None:
    """A PD decode node whose pool forces retracts to the host store."""
    with pool_service(page_size=4, num_pages=40, host_pools=8) as service:

        async def scenario() -> None:
            node = await DecodeNode(
                service, num_reserved_decode_tokens=0, disable_overlap_schedule=not overlap
            ).start()
            prompts = {f"d{i}": [i + 2] * (6 + 4 * i) for i in range(6)}
            for rid, prompt in prompts.items():
                node.submit(rid, prompt, 30)
            await node.run(before_step=lambda step: node.release())
            stats = node.engine.stats
            assert stats.retracted_reqs > 0, "the pool was meant to force retracts"
            assert (stats.reserved_ahead_steps > 0) is overlap
            for rid, prompt in prompts.items():
                assert node.done[rid].output_ids == expected_output(prompt, 30), rid
            service.pool.check_integrity(idle=True)

        asyncio.run(scenario())
