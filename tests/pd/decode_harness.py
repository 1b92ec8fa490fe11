"""A PD decode node in process: the real DecodeEngine and memsvc core, transfers held by the test.

``HeldTransferMem`` is the in-process memsvc client with the PD transfer ops
answered by the test instead of a prefill node: a room stays ``Transferring``
until the test releases it, then reports ``Success`` with the first token the
fake model's prefill would have sampled. The KV itself is never written (the
fake model reads only the slots), so what these tests check is the decode
node's memory bookkeeping: preallocation, commit, retract to the host store,
resume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memsvc.handlers import MemService
from memsvc.transfer import KVPoll
from scheduler_svc.core import Req, SamplingParams, SchedulerConfig, ceil_page
from scheduler_svc.pd.decode import DecodeEngine
from tests.scheduler.engine_harness import FakeModel, InProcessMem, next_token

OOM = "Out of memory even after retracting"


class HeldTransferMem(InProcessMem):
    """memsvc in process; a room's transfer succeeds only once the test releases it."""

    def __init__(self, service: MemService, name: str = "scheduler") -> None:
        super().__init__(service, name)
        self.expected: dict[int, str] = {}  # room -> rid, preallocated and awaiting its KV
        self.released: set[int] = set()
        self.first_tokens: dict[str, int] = {}

    async def pd_expect(self, rid: str, room: int) -> None:
        self.expected[room] = rid

    async def pd_status(self, rooms: list[int]) -> list[dict[str, Any]]:
        return [self._report(room) for room in rooms]

    async def pd_forget(self, rooms: list[int]) -> None:
        for room in rooms:
            self.expected.pop(room, None)
            self.released.discard(room)

    def _report(self, room: int) -> dict[str, Any]:
        done = room in self.released
        return {
            "room": room,
            "state": KVPoll.SUCCESS if done else KVPoll.TRANSFERRING,
            "first_token": self.first_tokens.get(self.expected.get(room, ""), -1),
            "cached_tokens": 0,
            "why": "",
        }


class DecodeNode:
    """A DecodeEngine over ``service`` whose transfers the test releases."""

    def __init__(self, service: MemService, **config: Any) -> None:
        self.service = service
        fields = dict(page_size=service.pool.page_size, max_running_requests=32)
        self.config = SchedulerConfig(**{**fields, **config})
        self.done: dict[str, Req] = {}
        self.reqs: dict[str, Req] = {}
        self.capacity = service.pool.capacity
        self._next_room = 1

    async def start(self) -> DecodeNode:
        self.mem = await HeldTransferMem.connect(self.service)
        self.model = FakeModel(self.service.pool.table.array)
        self.engine = DecodeEngine(
            self.config, self.mem, self.model, self._emit, capacity=self.capacity
        )
        return self

    def _emit(self, req: Req, finished: bool) -> None:
        if finished:
            self.done[req.rid] = req

    def submit(self, rid: str, prompt: list[int], max_new: int) -> Req:
        """A request whose prefill (on the prefill node) sampled ``next_token`` of its prompt."""
        req = Req(rid, prompt, SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0}))
        req.bootstrap_room, self._next_room = self._next_room, self._next_room + 1
        self.mem.first_tokens[rid] = next_token(prompt[-1], len(prompt) - 1)
        self.reqs[rid] = req
        self.engine.submit(req)
        return req

    def release(self, rids: set[str] | None = None) -> None:
        """Let the transfers of ``rids`` (all preallocated ones if None) succeed."""
        for room, rid in self.mem.expected.items():
            if rids is None or rid in rids:
                self.mem.released.add(room)

    def in_transfer(self) -> set[str]:
        return {r.rid for r in self.engine.transfer.values()}

    async def run(
        self, max_steps: int = 5000, before_step: Callable[[int], bool | None] | None = None
    ) -> None:
        """Step until idle, checking the budget after each step.

        ``before_step(i)`` may submit or release; it returns True while it has
        requests still to submit.
        """
        for i in range(max_steps):
            more = before_step(i) if before_step is not None else False
            stepped = await self.engine.step()
            self.check_growth_room()
            settled = self.engine.idle and all(r in self.done for r in self.reqs)
            if not (stepped or more) and settled:
                return
        raise AssertionError(f"the decode node did not go idle in {max_steps} steps")

    def final_len(self, req: Req) -> int:
        new = min(req.sampling_params.max_new_tokens, self.config.clip_max_new_tokens)
        return ceil_page(len(req.origin_input_ids) + new, self.config.page_size)

    def check_growth_room(self) -> None:
        """Every request that holds or awaits KV here can reach its final length
        alongside the slots the transfer queue holds (nothing retract can free).

        Only for requests that fit the pool alone: a larger one may run out.
        """
        page = self.config.page_size
        held = {
            r.rid: ceil_page(len(r.origin_input_ids) + max(len(r.output_ids) - 1, 0), page)
            for r in self.engine.transfer.values()
        }
        for req in [*self.engine.running, *self.engine.transfer.values()]:
            final = self.final_len(req)
            if final > self.capacity:
                continue
            others = sum(n for rid, n in held.items() if rid != req.rid)
            assert final + others <= self.capacity, (
                f"{req.rid} may need {final} tokens but the transfer queue holds {others} "
                f"of the pool's {self.capacity}: {sorted(held)}"
            )

    def oom_aborts(self) -> list[str]:
        return [
            rid
            for rid, req in self.done.items()
            if req.finish_reason.to_json().get("type") == "abort"
            and OOM in req.finish_reason.to_json().get("message", "")
        ]


async def park(node: DecodeNode, req: Req) -> None:
    """Retract running ``req`` to the host store, as the decode node's retract does."""
    await node.mem.offload(req.rid, req.kv_len)
    await node.mem.free_row(req.rid)
    node.engine.running.remove(req)
    req.reset_for_retract()
    req.host_copy = True
    node.engine.retracted.append(req)
