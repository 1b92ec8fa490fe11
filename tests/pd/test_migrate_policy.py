"""Whether a decode node moves a retracted request to its peer, per victim (issue 32).

The real DecodeEngine and memsvc core in process (:mod:`tests.pd.decode_harness`);
the peer is a stand-in that always has room, and takes nothing: each move it is
offered it refuses, so the request goes back to the head of the retracted queue
and resumes here. What is checked is the choice: with ``--migrate-policy cost``
a victim moves only when sending its KV takes less than waiting here for its
slots; with ``always``, whenever the peer has room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvstack.sim.worker import expected_output
from memsvc.handlers import MemService
from scheduler_svc.adopt import Journal, Owner
from scheduler_svc.core import Req, SamplingParams
from tests.helpers import pool_service
from tests.pd.decode_harness import DecodeNode


class RefusingPeer:
    """A peer with room for everything, which refuses each move once offered."""

    address = "ipc://peer"

    def __init__(self) -> None:
        self.offered: list[str] = []

    async def room_for(self, tokens: int) -> str:
        return "ipc://peer-transfer"

    async def hand_over(self, req: Req, room: int) -> None:
        self.offered.append(req.rid)

    def refused(self, rid: str) -> str | None:
        return "the test's peer takes nothing"

    async def cancel(self, rid: str) -> None:
        pass

    def finished(self, rid: str) -> None:
        pass


@pytest.fixture
def pool() -> Iterator[MemService]:
    with pool_service(4, num_pages=64) as svc:  # 256 tokens, a host store as large
        yield svc


def run_under_pressure(pool: MemService, **engine: Any) -> tuple[DecodeNode, RefusingPeer, list]:
    """Six requests whose growth overflows the pool: the node retracts some to the host
    store; returns the node, the peer and the rooms the node sent KV to."""
    sends: list[tuple[str, dict[str, Any]]] = []
    recorded: set[str] = set()

    async def scenario() -> DecodeNode:
        node = await DecodeNode(pool, num_reserved_decode_tokens=4).start()
        peer = RefusingPeer()
        node.engine.migration = peer
        for key, value in engine.items():
            obj = node.engine.cost if key in ("move_bytes_per_s", "decode_step_s") else node.engine
            setattr(obj, key, value)

        async def pd_send(rid: str, room: int, *args: Any, **kwargs: Any) -> None:
            sends.append((rid, kwargs))

        node.mem.pd_send = pd_send
        journal = engine.pop("journal", False)
        if journal:  # records for a successor (scheduler_svc.adopt)
            node.engine.journal = Journal(owner_of=lambda rid: Owner("c", "fp-" + rid, True))
        prompts = {f"r{i}": [(i + 5) * (j + 1) % 241 + 1 for j in range(30)] for i in range(6)}
        for rid, prompt in prompts.items():
            node.submit(rid, prompt, 40)
        node.release()

        def before_step(i: int) -> None:
            node.release()  # every transfer succeeds at once
            if journal:  # a request moving away is never one a successor would take
                moving = {r.rid for r in node.engine.migrating.values()}
                records = {rid for j in pool.journals._by_session.values() for rid in j.records}
                assert not moving & records, (moving, records)
                recorded.update(records)

        await node.run(before_step=before_step)
        assert node.engine.stats.retracted_reqs > 0, "the pool never ran short: no victim"
        for rid, prompt in prompts.items():
            assert node.done[rid].output_ids == expected_output(prompt, 40), rid
        pool.pool.check_integrity(idle=True)
        if journal:
            assert recorded == set(prompts), recorded  # each was recorded once its KV came
            await node.engine.commit_journal()  # (the last ends are told at the next commit)
            assert not any(j.records for j in pool.journals._by_session.values())
        node.peer = peer
        return node

    node = asyncio.run(scenario())
    return node, node.peer, sends


def test_a_slow_link_keeps_the_victim_waiting_here(pool: MemService) -> None:
    node, peer, sends = run_under_pressure(pool, move_bytes_per_s=1.0)
    assert sends == [] and peer.offered == []
    assert node.engine.stats.migrate_waited_steps > 0


def test_a_fast_link_moves_the_victim(pool: MemService) -> None:
    node, peer, sends = run_under_pressure(pool, move_bytes_per_s=1e15)
    assert sends and all(kwargs.get("from_host") for _, kwargs in sends)
    assert peer.offered == [rid for rid, _ in sends]
    assert node.engine.stats.migrate_failed == len(sends)  # each refused: resumed here


def test_always_moves_whatever_the_cost(pool: MemService) -> None:
    node, peer, sends = run_under_pressure(pool, move_bytes_per_s=1.0, migrate_always=True)
    assert peer.offered == [rid for rid, _ in sends]
    assert sends and node.engine.stats.migrate_waited_steps == 0


def test_the_journal_drops_a_request_while_it_moves(pool: MemService) -> None:
    """A PD decode node records each request once its KV arrived (a restarted scheduler
    adopts it); one moving to the peer has none (a successor must not resume it here
    while the peer runs it), and gets it back when the move fails."""
    node, _, sends = run_under_pressure(pool, move_bytes_per_s=1e15, journal=True)
    assert sends and node.engine.stats.migrate_failed == len(sends)


def test_a_draining_node_sends_running_requests_from_their_rows(pool: MemService) -> None:
    """Draining: each running request is offered to the peer straight from its pool pages
    (no host-store copy, no offload); the test's peer refuses every move, so each one
    decodes on from its row, its tokens unchanged, and the pool ends idle. Before: the
    node parked every running request in the host store first."""
    sends: list[tuple[str, dict[str, Any]]] = []
    offloads: list[str] = []

    async def scenario() -> DecodeNode:
        node = await DecodeNode(pool, num_reserved_decode_tokens=4).start()
        node.engine.migration = RefusingPeer()
        node.engine.draining = True

        async def pd_send(rid: str, room: int, *args: Any, **kwargs: Any) -> None:
            sends.append((rid, kwargs))

        real_offload = node.mem.offload

        async def offload(rid: str, *args: Any, **kwargs: Any) -> Any:
            offloads.append(rid)
            return await real_offload(rid, *args, **kwargs)

        node.mem.pd_send, node.mem.offload = pd_send, offload
        prompts = {f"r{i}": [(i + 3) * (j + 1) % 241 + 1 for j in range(30)] for i in range(2)}
        for rid, prompt in prompts.items():
            node.submit(rid, prompt, 12)
        await node.run(before_step=lambda i: node.release())
        for rid, prompt in prompts.items():
            assert node.done[rid].output_ids == expected_output(prompt, 12), rid
        pool.pool.check_integrity(idle=True)
        return node

    node = asyncio.run(scenario())
    assert sends and {rid for rid, _ in sends} == {"r0", "r1"}
    assert not any(kwargs.get("from_host") for _, kwargs in sends)
    assert offloads == [] and node.engine.stats.retracted_reqs == 0
    assert node.engine.stats.migrate_failed == len(sends)


def test_a_request_moved_here_is_never_recorded(pool: MemService) -> None:
    """The journal leaves out a request another decode node moved here: that node relays
    its replies (and ends it if this scheduler dies), so a successor here must not
    decode it for nobody. A local request beside it is recorded; both end exact."""
    prompts = {rid: [(k + 7) * (j + 1) % 241 + 1 for j in range(30)] for k, rid in enumerate("lm")}
    recorded: set[str] = set()

    async def scenario() -> DecodeNode:
        node = await DecodeNode(pool, num_reserved_decode_tokens=4).start()
        node.engine.journal = Journal(owner_of=lambda rid: Owner("c", "fp-" + rid, True))
        node.submit("l", prompts["l"], 12)
        draw = {"temperature": 0.0}
        moved = Req("m", prompts["m"], SamplingParams(max_new_tokens=12, draw=draw))
        moved.output_ids = expected_output(prompts["m"], 12)[:3]  # made on the other node
        moved.bootstrap_room = 99
        moved.arrive_migrated(retractions=1, cached_tokens=0)
        node.reqs["m"] = moved
        node.engine.accept_migrated(moved)

        def before_step(i: int) -> None:
            node.release()
            recorded.update(rid for j in pool.journals._by_session.values() for rid in j.records)

        await node.run(before_step=before_step)
        for rid, prompt in prompts.items():
            assert node.done[rid].output_ids == expected_output(prompt, 12), rid
        pool.pool.check_integrity(idle=True)
        return node

    node = asyncio.run(scenario())
    assert node.engine.stats.migrated_in_reqs == 1
    assert recorded == {"l"}, recorded
