"""The scheduling loop with a real memsvc core (in process) and a deterministic fake model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from memsvc.core import KVPool
from memsvc.handlers import MemService
from scheduler_svc.core import (
    RETRACT_ABORT_MESSAGE,
    PrefillAdder,
    Req,
    ReqState,
    SamplingParams,
    SchedulerConfig,
)
from scheduler_svc.engine import Engine, prefill_round
from tests.helpers import pool_service
from tests.scheduler.engine_harness import FakeModel, InProcessMem, expected_output

PAGE = 4


@pytest.fixture
def service() -> Iterator[MemService]:
    with pool_service(PAGE) as svc:
        yield svc


class Harness:
    def __init__(self, service: MemService, **config) -> None:
        self.service = service
        fields = dict(page_size=service.pool.page_size, max_running_requests=16)
        self.config = SchedulerConfig(**{**fields, **config})
        self.done: dict[str, Req] = {}
        self.emitted: dict[str, int] = {}

    async def start(self) -> Harness:
        self.mem = await InProcessMem.connect(self.service)
        self.model = FakeModel(self.service.pool.table.array)
        self.engine = Engine(
            self.config, self.mem, self.model, self._emit, capacity=self.service.pool.capacity
        )
        return self

    def _emit(self, req: Req, finished: bool) -> None:
        self.emitted[req.rid] = self.emitted.get(req.rid, 0) + 1
        if finished:
            self.done[req.rid] = req

    def submit(self, rid: str, prompt: list[int], max_new: int) -> Req:
        req = Req(rid, prompt, SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0}))
        self.engine.submit(req)
        return req

    async def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not await self.engine.step() and self.engine.idle:
                return
        raise AssertionError("the engine did not go idle")


def run(coro):
    return asyncio.run(coro)


def test_every_request_finishes_with_the_right_tokens_under_churn(service) -> None:
    async def scenario() -> None:
        h = await Harness(service, test_retract=True, test_retract_interval=2).start()
        prompts = {f"r{i}": [i + 1] * (3 + 2 * i) for i in range(6)}
        for rid, prompt in prompts.items():
            h.submit(rid, prompt, 12)
        await h.run()
        assert h.engine.stats.retracted_reqs > 0
        for rid, prompt in prompts.items():
            req = h.done[rid]
            assert req.output_ids == expected_output(prompt, 12), rid
            assert req.finish_reason.to_json() == {"type": "length", "length": 12}
        assert sum(r.retraction_count for r in h.done.values()) == h.engine.stats.retracted_reqs
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_recomputed_victims_teach_the_cost_model_their_tree_hits(service) -> None:
    async def scenario() -> None:
        h = await Harness(service, test_retract=True, test_retract_interval=2).start()
        for i in range(6):
            h.submit(f"r{i}", [i + 1] * (9 + 2 * i), 12)
        await h.run()
        assert h.engine.stats.retracted_reqs > 0
        # A roomy pool: the tree keeps every victim's published prompt, so the
        # estimate moves from its prior (half) towards whole-prompt hits.
        assert h.engine.cost.hit_fraction > 0.5
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_abort_while_waiting_after_a_retract_returns_partial_output(service) -> None:
    async def scenario() -> None:
        h = await Harness(service, test_retract=True, test_retract_interval=1).start()
        h.submit("keep", [1, 2, 3, 4, 5, 6, 7, 8], 30)
        victim = h.submit("victim", [9] * 20, 30)  # longest input: retracted first
        for _ in range(200):
            await h.engine.step()
            if victim.state is ReqState.RETRACTED:
                break
        assert victim.state is ReqState.RETRACTED and victim.output_ids
        partial = list(victim.output_ids)
        assert h.engine.abort("victim")
        await h.engine.step()
        assert h.done["victim"].output_ids == partial
        assert h.done["victim"].finish_reason.to_json()["type"] == "abort"
        assert not h.engine.abort("victim")  # gone
        await h.run()
        assert h.done["keep"].output_ids == expected_output([1, 2, 3, 4, 5, 6, 7, 8], 30)
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_last_request_is_aborted_with_500_when_even_it_cannot_continue(service) -> None:
    async def scenario() -> None:
        h = await Harness(service).start()
        long = h.submit("long", [3] * 8, 100)
        other = h.submit("other", [4] * 40, 60)
        for _ in range(3):  # both admitted (one round) and decoding
            await h.engine.step()
        assert long.state is ReqState.RUNNING and other.state is ReqState.RUNNING
        # Another session takes every free page: the batch cannot grow any more.
        hog = await InProcessMem.connect(service, name="hog")
        await hog.alloc_row("hog")
        assert (await hog.alloc_extend([("hog", hog.sizes.available)])).fits
        for _ in range(500):
            await h.engine.step()
            if "long" in h.done:
                break
        # "other" (equal outputs, longest prompt) was retracted first; "long" then ran
        # out of room alone and was aborted, with its partial output
        assert h.done["long"].finish_reason.to_json() == {
            "type": "abort",
            "message": RETRACT_ABORT_MESSAGE,
            "status_code": 500,
        }
        assert 0 < len(h.done["long"].output_ids) < 100
        assert other.retraction_count >= 1 and "other" not in h.done
        await hog.free_row("hog")
        await h.run()
        # the retracted one finishes normally, with the tokens it would have had anyway
        assert h.done["other"].output_ids == expected_output([4] * 40, 60)
        h.submit("after", [5, 6, 7], 5)  # the scheduler keeps serving
        await h.run()
        assert h.done["after"].output_ids == expected_output([5, 6, 7], 5)
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_chunked_prefill_computes_in_chunks_and_matches(service) -> None:
    async def scenario() -> None:
        h = await Harness(service, chunked_prefill_size=8).start()
        prompt = list(range(1, 31))  # 30 tokens: chunks of 8, 8, 8, 6
        h.submit("chunky", prompt, 6)
        h.submit("small", [7, 7], 6)
        await h.run()
        assert h.done["chunky"].output_ids == expected_output(prompt, 6)
        assert h.done["small"].output_ids == expected_output([7, 7], 6)
        assert h.model.calls.count("extend") >= 4
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_ratio_decays_on_clean_steps_and_is_set_after_a_retract(service) -> None:
    async def scenario() -> None:
        h = await Harness(service).start()
        ratio = h.engine.ratio
        h.submit("a", [1, 2, 3], 20)
        await h.engine.step()  # the prefill: no decay
        assert ratio.current == pytest.approx(ratio.init_ratio)
        for _ in range(5):  # clean decode steps
            await h.engine.step()
        assert ratio.current == pytest.approx(ratio.init_ratio - 5 * ratio.decay)
        await h.run()
        assert ratio.current == pytest.approx(ratio.init_ratio)  # idle resets it

        h2 = await Harness(service, test_retract=True, test_retract_interval=3).start()
        h2.submit("x", [1] * 5, 10)
        h2.submit("y", [2] * 9, 10)
        while h2.engine.stats.retract_events == 0:
            assert await h2.engine.step()
        # assigned, not decayed, in the step that retracted
        expected = h2.engine.ratio.estimate_after_retract(h2.engine.running)
        assert h2.engine.ratio.current == pytest.approx(expected)
        assert h2.engine.stats.last_ratio_after_retract == pytest.approx(expected)
        await h2.run()
        service.pool.check_integrity(idle=True)

    run(scenario())


@pytest.mark.parametrize("mode", ["offload", "auto"])
def test_offload_mode_brings_victims_back_from_the_host_store(service, mode) -> None:
    async def scenario() -> None:
        h = await Harness(
            service, test_retract=True, test_retract_interval=2, retract_mode=mode
        ).start()
        if mode == "auto":  # make offload the cheaper way back for every victim
            h.engine.cost.copy_bytes_per_s = 1e15
        prompts = {f"r{i}": [i + 1] * (3 + 2 * i) for i in range(6)}
        for rid, prompt in prompts.items():
            h.submit(rid, prompt, 12)
        await h.run()
        stats = h.engine.stats
        assert stats.retracted_reqs > 0
        assert stats.offloaded_reqs == stats.retracted_reqs == stats.loaded_reqs
        assert stats.reprefilled_tokens == 0  # nothing recomputed: every victim was loaded
        for rid, prompt in prompts.items():
            assert h.done[rid].output_ids == expected_output(prompt, 12), rid
        assert len(service.pool.host_store) == 0
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_auto_mode_recomputes_when_copying_costs_more(service) -> None:
    async def scenario() -> None:
        h = await Harness(
            service, test_retract=True, test_retract_interval=2, retract_mode="auto"
        ).start()
        h.engine.cost.copy_bytes_per_s = 1.0  # copying is hopeless
        for i in range(4):
            h.submit(f"r{i}", [i + 1] * 9, 10)
        await h.run()
        assert h.engine.stats.retracted_reqs > 0
        assert h.engine.stats.offloaded_reqs == 0
        assert h.engine.stats.reprefilled_tokens > 0
        service.pool.check_integrity(idle=True)

    run(scenario())


def test_aborting_a_request_parked_in_the_host_store_discards_its_copy(service) -> None:
    async def scenario() -> None:
        h = await Harness(
            service, test_retract=True, test_retract_interval=1, retract_mode="offload"
        ).start()
        h.submit("keep", [1, 2, 3, 4, 5, 6, 7, 8], 30)
        victim = h.submit("victim", [9] * 20, 30)
        for _ in range(200):
            await h.engine.step()
            if victim.state is ReqState.RETRACTED:
                break
        assert victim.host_copy and "victim" in service.pool.host_store
        partial = list(victim.output_ids)
        assert h.engine.abort("victim")
        await h.engine.step()
        assert h.done["victim"].output_ids == partial
        assert "victim" not in service.pool.host_store
        await h.run()
        service.pool.check_integrity(idle=True)

    run(scenario())


@pytest.mark.parametrize("charge", ["full", "remaining"])
def test_a_retracted_request_that_fits_only_alone_is_not_starved(service, charge) -> None:
    """A retracted request whose whole max_new_tokens on top of the output it already
    has would not fit the pool is still re-admitted, under either charge: admission
    checks what it has left to generate (SGLang too); only the reservation differs."""

    async def scenario() -> None:
        h = await Harness(
            service,
            readmit_charge=charge,
            retraction_policy="priority",
            enable_priority_scheduling=True,
            schedule_conservativeness=0.1,
        ).start()
        keep = Req("keep", [1] * 8, SamplingParams(max_new_tokens=100), priority=10)
        victim = Req("victim", [2] * 8, SamplingParams(max_new_tokens=200), priority=0)
        h.engine.submit(keep)
        h.engine.submit(victim)
        while len(victim.output_ids) < 60:
            await h.engine.step()
        await h.engine._retract(kv_full=False)  # the low-priority one is the victim
        assert victim.state is ReqState.RETRACTED and keep.state is ReqState.RUNNING
        service.pool.evict(service.pool.capacity)  # pressure evicted its cached prefix
        await h.run()
        # 68 tokens + a page + 200 would be over the 256-token pool.
        assert h.done["keep"].output_ids == expected_output([1] * 8, 100)
        assert h.done["victim"].output_ids == expected_output([2] * 8, 200)
        service.pool.check_integrity(idle=True)

    run(scenario())


# -- agreement with SGLang 0.5.23 (issue 19) ---------------------------------------------


def seed_tree(pool: KVPool, rid: str, tokens: list[int]) -> None:
    """Leave ``tokens`` cached (evictable) in the tree, as a finished request would."""
    pool.open_request(rid)
    assert pool.alloc_extend([(rid, len(tokens))]) is not None
    pool.release(rid, tokens, is_insert=True)


def record_adders(monkeypatch: pytest.MonkeyPatch) -> list[PrefillAdder]:
    """Every PrefillAdder the engine builds from now on, in order."""
    made: list[PrefillAdder] = []

    class Recording(PrefillAdder):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(prefill_round, "PrefillAdder", Recording)
    return made


def test_admission_budget_leaves_out_the_prefix_it_locks(monkeypatch) -> None:
    """Item 2 (page 16, 28 pages): the tree holds 16 tokens that a 17-token request shares.
    Once its match locks them they are no longer evictable: 224 tokens of budget are left
    after admitting it, as in SGLang, not 240."""
    adders = record_adders(monkeypatch)
    with pool_service(page_size=16, num_pages=28) as service:

        async def scenario() -> None:
            shared = list(range(1, 17))
            seed_tree(service.pool, "seed", shared)
            h = await Harness(service).start()
            req = h.submit("r", [*shared, 99], 176)
            await h.engine.step()
            assert req.prefix_len == 16
            assert adders[-1].remaining_total_tokens == 448 - 16 - (16 + 16 + 176)
            await h.run()
            assert h.done["r"].output_ids == expected_output([*shared, 99], 176)
            service.pool.check_integrity(idle=True)

        run(scenario())


def test_admitted_requests_are_allocated_after_their_prefixes_are_locked() -> None:
    """Item 4 (page 64, chunked): the in-progress chunk's pages must not come from evicting
    the prefix the next request in the same round matches. SGLang allocates after the
    admission loop, with that prefix locked: the request gets its 64-token hit, and the
    newer cached prompt is evicted instead."""
    with pool_service(page_size=64, num_pages=16) as service:

        async def scenario() -> None:
            pool = service.pool
            h = await Harness(service, chunked_prefill_size=128).start()
            long_prompt = list(range(1000, 1192))  # chunks of 128, then 64
            h.submit("chunked", long_prompt, 8)
            await h.engine.step()
            assert h.engine.chunked is not None
            shared = [7] * 64
            seed_tree(pool, "shared", shared)  # older: the LRU victim
            seed_tree(pool, "newer", list(range(2000, 2320)))
            hog = await InProcessMem.connect(service, name="hog")
            await hog.alloc_row("hog")
            assert (await hog.alloc_extend([("hog", hog.sizes.available)])).fits
            assert pool.available_size() == 0
            req = h.submit("sharer", [*shared, *[8] * 10], 8)
            await h.engine.step()  # the last chunk and the sharer, in one round
            assert req.prefix_len == 64
            await hog.free_row("hog")
            await h.run()
            assert h.done["chunked"].output_ids == expected_output(long_prompt, 8)
            assert h.done["sharer"].output_ids == expected_output([*shared, *[8] * 10], 8)
            pool.check_integrity(idle=True)

        run(scenario())


def test_admissions_that_get_no_pages_go_back_to_the_queue_as_they_were(service) -> None:
    """Another session takes pages between the budget and the allocation after the
    admission loop: the last admission is undone (row freed, back at the queue head,
    not counted as a retraction) and the rest of the round runs."""

    async def scenario() -> None:
        h = await Harness(service).start()
        a = h.submit("a", [1] * 8, 4)
        b = h.submit("b", [2] * 8, 4)
        hog = await InProcessMem.connect(service, name="hog")
        await hog.alloc_row("hog")
        admit = h.engine.mem.admit

        async def admit_then_hog(items):
            reply = await admit(items)
            if "b" in [rid for rid, _ in items]:  # leave room for a's 2 pages only
                assert (await hog.alloc_extend([("hog", hog.sizes.available - 8)])).fits
            return reply

        h.engine.mem.admit = admit_then_hog
        await h.engine.step()
        h.engine.mem.admit = admit
        assert a.state is ReqState.RUNNING
        assert (b.state, b.row, b.retraction_count) == (ReqState.WAITING, None, 0)
        assert h.engine.waiting[0] is b
        service.pool.check_integrity()
        await hog.free_row("hog")
        await h.run()
        assert h.done["a"].output_ids == expected_output([1] * 8, 4)
        assert h.done["b"].output_ids == expected_output([2] * 8, 4)
        service.pool.check_integrity(idle=True)

    run(scenario())
