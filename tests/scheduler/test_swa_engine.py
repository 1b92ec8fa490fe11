"""The normal-mode engine consults the SWA gate when the pool is hybrid (issue 29, item 3).

The SWA pool's numbers are injected (``engine.swa_budget_inputs``), as memsvc's
replies will carry them for a hybrid pool; the pool itself is an ordinary
in-process one, so what is checked is the wiring: admission refuses what the
SWA budget refuses, a parked chunk waits unallocated and then resumes, and
without SWA numbers nothing changes. Outputs stay exact and the pool whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from memsvc.handlers import MemService
from scheduler_svc.core.swa_budget import SwaSizes, SwaSpec
from tests.helpers import pool_service
from tests.scheduler.engine_harness import expected_output
from tests.scheduler.test_engine import Harness

PAGE = 4
SPEC = SwaSpec(sliding_window=8, capacity=64, page_size=PAGE)


@pytest.fixture
def service() -> Iterator[MemService]:
    with pool_service(PAGE) as svc:
        yield svc


def inject(h: Harness, swa: dict[str, int]) -> None:
    """The engine reads the SWA pool's free tokens from ``swa["available"]``."""
    h.engine.swa_budget_inputs = lambda sizes: (SPEC, SwaSizes(swa["available"], 0))


def test_admission_stops_at_the_swa_budget(service) -> None:
    async def scenario() -> None:
        h = await Harness(service).start()
        inject(h, {"available": 30})
        prompts = {f"r{i}": [i + 5] * 12 for i in range(3)}
        for rid, prompt in prompts.items():
            h.submit(rid, prompt, 4)
        await h.engine.step()
        # each reserves max(12 - 8, 0) + min(12 + 4, 8) + 4 = 16 SWA tokens: 16 < 30,
        # then 16 >= 14 left: one admitted (the full pool had room for all three)
        assert [r.rid for r in h.engine.running] == ["r0"]
        assert [r.rid for r in h.engine.waiting] == ["r1", "r2"]
        await h.run()
        for rid, prompt in prompts.items():
            assert h.done[rid].output_ids == expected_output(prompt, 4), rid
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_without_swa_numbers_admission_is_unchanged(service) -> None:
    async def scenario() -> None:
        h = await Harness(service).start()
        assert h.engine.swa is None and h.engine.swa_budget_inputs(h.mem.sizes) is None
        for i in range(3):
            h.submit(f"r{i}", [i + 5] * 12, 4)
        await h.engine.step()
        assert len(h.engine.running) == 3
        await h.run()
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_swa_budget_parks_the_in_progress_chunk_then_it_resumes(service) -> None:
    async def scenario() -> None:
        h = await Harness(service, chunked_prefill_size=8).start()
        swa = {"available": 40}
        inject(h, swa)
        short_prompt, prompt = [5] * 4, [3] * 30
        h.submit("short", short_prompt, 40)  # running while the long one is chunked
        req = h.submit("long", prompt, 4)
        await h.engine.step()  # short whole (4 tokens), long's first chunk (the rest: 4)
        await h.engine.step()  # the second chunk: 8 more
        assert [r.rid for r in h.engine.running] == ["short"]
        assert h.engine.chunked is req and req.kv_len == 12
        computed = h.model.extend_tokens
        swa["available"] = PAGE  # min(8, total, 4 - 4) = 0: parked
        for _ in range(3):
            await h.engine.step()
        assert h.engine.chunked is req and req.kv_len == 12
        assert h.model.extend_tokens == computed  # nothing computed, nothing allocated
        assert "short" not in h.done and len(h.engine.running) == 1  # decoding goes on
        swa["available"] = 40
        await h.run()
        assert h.done["long"].output_ids == expected_output(prompt, 4)
        assert h.done["short"].output_ids == expected_output(short_prompt, 40)
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_with_nothing_running_a_chunk_is_not_parked(service) -> None:
    async def scenario() -> None:
        h = await Harness(service, chunked_prefill_size=8).start()
        swa = {"available": 40}
        inject(h, swa)
        prompt = [3] * 30
        req = h.submit("long", prompt, 4)
        await h.engine.step()  # the first chunk: 8 tokens
        swa["available"] = PAGE  # the SWA budget would park it now
        await h.engine.step()
        assert req.kv_len == 16  # not parked: no decode would ever free SWA pages
        await h.run()
        assert h.done["long"].output_ids == expected_output(prompt, 4)
        assert req.finish_reason is not None
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())
