"""The PD decode node's preallocation budget (SGLang's ``pop_preallocated``), in process.

The real DecodeEngine and memsvc core, the engine tests' fake model, and KV
transfers the test holds back (:mod:`tests.pd.decode_harness`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvstack.sim.worker import expected_output
from memsvc.handlers import MemService
from tests.helpers import pool_service
from tests.pd.decode_harness import DecodeNode, park

PAGE = 4


@pytest.fixture
def demo_pool() -> Iterator[MemService]:
    """The demo's decode pool: 64 pages of 4 tokens, a host store as large."""
    with pool_service(PAGE, num_pages=64) as svc:
        yield svc


def test_a_running_request_keeps_room_to_finish_while_a_transfer_is_held(demo_pool) -> None:
    """`make demo`'s abort (issue 35): the long request must never be left alone without room.

    The demo's shapes: a 256-token pool, R = 8, a 199-token prompt with 40 new
    tokens, then short requests. Without SGLang's single-request term the
    budget (56 free - 8) admits ``short-0``'s 40 slots while ``long`` still has
    38 tokens to grow; its KV is held back, so ``long`` runs alone, runs out of
    pages with nothing to retract, and is aborted.
    """

    async def scenario() -> None:
        node = await DecodeNode(demo_pool, num_reserved_decode_tokens=8).start()
        long_prompt = [(7 * i) % 251 + 1 for i in range(199)]
        node.submit("long", long_prompt, 40)
        node.release({"long"})
        shorts = {
            f"short-{i}": [(i + 3) * (j + 1) % 249 + 1 for j in range(40 - i)] for i in range(4)
        }

        def before_step(i: int) -> None:
            if i == 3:
                for rid, prompt in shorts.items():
                    node.submit(rid, prompt, 30)
            if "long" in node.done or i > 400:  # hold the short ones' KV until then
                node.release()

        await node.run(before_step=before_step)
        assert not node.oom_aborts(), {r: node.done[r].finish_reason.to_json() for r in node.done}
        assert node.done["long"].output_ids == expected_output(long_prompt, 40)
        for rid, prompt in shorts.items():
            assert node.done[rid].output_ids == expected_output(prompt, 30), rid
        demo_pool.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_a_request_still_in_transfer_keeps_room_to_finish(demo_pool) -> None:
    """Beyond SGLang (docs/sglang-differences.md): its term protects running requests only.

    ``long`` is preallocated but its KV has not arrived when the short ones
    come: SGLang's budget (nothing running) would give ``short-0`` 24 slots
    (its 44 tokens in all pass the gate beside 56 free), and if ``short-0``'s
    KV then came late, ``long`` would run alone short of pages. The transfer
    queue's own growth is kept back too.
    """

    async def scenario() -> None:
        node = await DecodeNode(demo_pool, num_reserved_decode_tokens=8).start()
        long_prompt = [(5 * i) % 241 + 1 for i in range(199)]
        node.submit("long", long_prompt, 40)
        shorts = {f"short-{i}": [i + 2] * (24 - i) for i in range(3)}
        for rid, prompt in shorts.items():
            node.submit(rid, prompt, 20)

        def before_step(i: int) -> None:
            if i == 5:
                assert node.in_transfer() == {"long"}
                node.release({"long"})
            if "long" in node.done:
                node.release()

        await node.run(before_step=before_step)
        assert not node.oom_aborts()
        assert node.done["long"].output_ids == expected_output(long_prompt, 40)
        for rid, prompt in shorts.items():
            assert node.done[rid].output_ids == expected_output(prompt, 20), rid
        demo_pool.pool.check_integrity(idle=True)

    asyncio.run(scenario())


@pytest.fixture
def hundred_tokens() -> Iterator[MemService]:
    """100 slots of one token each."""
    with pool_service(1, num_pages=100) as svc:
        yield svc


def test_a_request_resumed_in_the_same_step_is_not_retractable_yet(hundred_tokens) -> None:
    """SGLang 0.5.23 resumes into its waiting queue: the budget sees no running request.

    One retracted request (8-token prompt, 9 outputs, max_new 4096) and one
    waiting request (13-token prompt, max_new 80), R = 0. After the resume
    84 slots are free. SGLang's gate for the waiting request is
    13 + 80 - 0 retractable = 93 > 84: nothing is preallocated. Counting the
    resumed request's 17 tokens as retractable (76 <= 84) would preallocate it.
    """

    async def scenario() -> None:
        node = await DecodeNode(hundred_tokens, num_reserved_decode_tokens=0).start()
        old = node.submit("old", [3] * 8, 4096)
        for _ in range(100):
            await node.engine.step()
            node.release()
            if len(old.output_ids) == 9:
                break
        await park(node, old)
        assert hundred_tokens.pool.available_size() == 100  # 16 tokens in the host store
        node.submit("new", [5] * 13, 80)
        await node.engine.step()  # resume "old" (84 free), then the gate for "new"
        assert node.engine.running == [old]
        assert list(node.engine.prealloc) == [node.reqs["new"]], node.engine.timeline
        for rid in ("old", "new"):
            node.engine.abort(rid)
        await node.run()
        hundred_tokens.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_an_idle_node_lets_in_a_request_whose_kv_alone_fits(hundred_tokens) -> None:
    """docs/sglang-differences.md row 9: on an idle node neither the reserve nor the
    prompt + max_new gate holds a request back, only its KV must fit.

    SGLang's gate (10 + 200 > 100 slots) would keep it waiting for ever; here
    it runs, and ends when it outgrows the pool.
    """

    async def scenario() -> None:
        node = await DecodeNode(hundred_tokens, num_reserved_decode_tokens=0).start()
        req = node.submit("big", [5] * 10, 200)
        await node.engine.step()
        assert node.in_transfer() == {"big"}
        node.release()
        await node.run()
        assert node.oom_aborts() == ["big"]
        assert len(req.output_ids) == 100 - 10 + 1  # every slot filled, then one token more
        hundred_tokens.pool.check_integrity(idle=True)

    asyncio.run(scenario())
