"""The PD decode node's SWA budgets (issue 29, item 3): preallocation and resume gate on the
SWA pool as SGLang 0.5.23 does (``_swa_aware_allocatable_token_budgets``, D41-D43).

The SWA pool's numbers are injected (``engine.swa_budget_inputs``) beside an
ordinary in-process pool: the full budget has room for everything, so every
request held back here is held back by the SWA gate. Outputs stay exact and
the pool whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvstack.sim.worker import expected_output
from memsvc.handlers import MemService
from scheduler_svc.core.swa_budget import SwaSizes, SwaSpec
from tests.helpers import pool_service
from tests.pd.decode_harness import DecodeNode, park

PAGE = 4
R = 8
SPEC = SwaSpec(sliding_window=8, capacity=64, page_size=PAGE)


@pytest.fixture
def service() -> Iterator[MemService]:
    with pool_service(PAGE, num_pages=64) as svc:
        yield svc


def inject(node: DecodeNode, swa: dict[str, int]) -> None:
    node.engine.swa_budget_inputs = lambda sizes: (SPEC, SwaSizes(swa["available"], 0))


def prompt(i: int) -> list[int]:
    return [(i + 3) * (j + 1) % 249 + 1 for j in range(20)]


def test_preallocation_gates_on_the_swa_budget(service) -> None:
    async def scenario() -> None:
        node = await DecodeNode(service, num_reserved_decode_tokens=R).start()
        swa = {"available": 20}
        inject(node, swa)
        node.submit("a", prompt(0), 10)
        node.submit("b", prompt(1), 10)
        await node.engine.step()
        # a: swa_required = ceil_page(tail(20) = 20 - 12) + R = 16; gate max(16, 8 + 10 - 0)
        # = 18 <= 20; then 20 - 16 = 4 left: b's 18 does not fit (head of line)
        assert node.in_transfer() == {"a"}
        assert [r.rid for r in node.engine.prealloc] == ["b"]
        swa["available"] = 40
        node.release()
        await node.run(before_step=lambda i: node.release())
        for i, rid in enumerate("ab"):
            assert node.done[rid].output_ids == expected_output(prompt(i), 10), rid
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_preallocation_without_swa_numbers_is_unchanged(service) -> None:
    async def scenario() -> None:
        node = await DecodeNode(service, num_reserved_decode_tokens=R).start()
        node.submit("a", prompt(0), 10)
        node.submit("b", prompt(1), 10)
        await node.engine.step()
        assert node.in_transfer() == {"a", "b"}
        await node.run(before_step=lambda i: node.release())
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_resume_gates_on_the_swa_budget_recomputed_from_the_pool(service) -> None:
    async def scenario() -> None:
        node = await DecodeNode(service, num_reserved_decode_tokens=R).start()
        swa = {"available": 60}
        inject(node, swa)
        node.submit("a", prompt(0), 30)
        node.submit("b", prompt(1), 30)
        node.release()
        for _ in range(5):
            await node.engine.step()
            node.release()
            if len(node.engine.running) == 2:
                break
        b = next(r for r in node.engine.running if r.rid == "b")
        await park(node, b)
        fill_len = len(b.origin_input_ids) + len(b.output_ids) - 1
        # a runs (n_active 1): SWA used 64 - 19 = 45 >= 1 x W, no growth reserve; the
        # budget is what is free. b needs ceil_page(tail(fill_len)) + R
        tail = fill_len - (fill_len - 8) // PAGE * PAGE
        required = -(-tail // PAGE) * PAGE + R
        swa["available"] = required - 1
        await node.engine.step()
        assert [r.rid for r in node.engine.retracted] == ["b"]
        swa["available"] = required
        await node.engine.step()
        assert not node.engine.retracted and b in node.engine.running
        await node.run(before_step=lambda i: node.release())
        for i, rid in enumerate("ab"):
            assert node.done[rid].output_ids == expected_output(prompt(i), 30), rid
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())
