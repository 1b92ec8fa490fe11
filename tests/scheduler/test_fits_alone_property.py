"""A request that fits the pool alone is never aborted for lack of memory (issue 35).

Seeded property tests over random workloads, in normal mode (the engine
tests' harness) and on a PD decode node (transfers held back for random
numbers of steps): prompt lengths, ``max_new_tokens``, arrival order and
steps, the decode reserve. Every request has ``prompt + min(max_new, clip)``
within the pool (and is admissible on an empty pool: its prompt, a page
and its ``max_new_tokens`` below the pool, admission's own rule), so retract
must always find it room: no request may end
with "Out of memory even after retracting ...", every output equals the
fake model's, and the pool is whole when idle.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvstack.sim.worker import expected_output
from scheduler_svc.core import RETRACT_ABORT_MESSAGE
from tests.helpers import pool_service
from tests.pd.decode_harness import DecodeNode
from tests.scheduler.test_engine import Harness

SEEDED = settings(
    max_examples=150,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    deadline=None,
    derandomize=True,  # the same workloads every run: a failure reproduces
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    page = draw(st.sampled_from([1, 4]))
    num_pages = draw(st.integers(64, 160)) // page
    capacity = page * num_pages
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        # What admission takes on an empty pool: ceil_page(prompt) + page + max_new < pool.
        longest = capacity - 2 * page - 1
        prompt_len = draw(st.integers(1, longest // 4) | st.integers(1, longest))
        room = capacity - -(-prompt_len // page) * page - page - 1
        max_new = draw(st.integers(min(room, 20), min(room, 120)))
        arrival = draw(st.integers(0, 8))
        delay = draw(st.integers(0, 40))  # PD: steps between preallocation and the KV
        reqs.append((f"r{i}", prompt_len, max_new, arrival, delay))
    # Optimistic admission (the demo's 0.3) retracts often; SGLang's default seldom.
    conservativeness = draw(st.sampled_from([0.3, 1.0]))
    return {
        "page": page,
        "num_pages": num_pages,
        "reqs": reqs,
        "conservativeness": conservativeness,
    }


def prompt_of(rid: str, length: int) -> list[int]:
    salt = int(rid[1:]) * 31
    return [(salt + j * 7) % 250 + 1 for j in range(length)]


def describe(done: dict) -> dict:
    return {rid: req.finish_reason.to_json() for rid, req in done.items()}


def check_outputs(done: dict, reqs: list) -> None:
    aborted = {r: d for r, d in describe(done).items() if RETRACT_ABORT_MESSAGE in str(d)}
    assert not aborted, f"requests that fit the pool alone were aborted: {aborted}"
    for rid, prompt_len, max_new, *_ in reqs:
        assert rid in done, f"{rid} never finished: {describe(done)}"
        expected = expected_output(prompt_of(rid, prompt_len), max_new)
        assert done[rid].output_ids == expected, (rid, done[rid].finish_reason.to_json())


def test_normal_mode_never_aborts_a_request_that_fits_alone() -> None:
    retracted: list[int] = []

    async def scenario(service, work: dict) -> None:
        h = await Harness(service, schedule_conservativeness=work["conservativeness"]).start()
        pending = sorted(work["reqs"], key=lambda r: r[3])
        for step in range(20000):
            while pending and pending[0][3] <= step:
                rid, prompt_len, max_new, *_ = pending.pop(0)
                h.submit(rid, prompt_of(rid, prompt_len), max_new)
            if not await h.engine.step() and h.engine.idle and not pending:
                break
        check_outputs(h.done, work["reqs"])
        retracted.append(h.engine.stats.retracted_reqs)
        service.pool.check_integrity(idle=True)

    @SEEDED
    @given(workloads())
    def check(work: dict) -> None:
        with pool_service(work["page"], work["num_pages"]) as service:
            asyncio.run(scenario(service, work))

    check()
    assert sum(map(bool, retracted)) >= 5, f"too few workloads retracted: {retracted}"


def test_pd_decode_never_aborts_a_request_that_fits_alone() -> None:
    retracted: list[int] = []

    async def scenario(service, work: dict, reserve: int) -> None:
        node = await DecodeNode(service, num_reserved_decode_tokens=reserve).start()
        pending = sorted(work["reqs"], key=lambda r: r[3])
        delays = {rid: delay for rid, *_, delay in work["reqs"]}
        seen: dict[str, int] = {}  # rid -> the step its slots were preallocated

        def before_step(step: int) -> bool:
            while pending and pending[0][3] <= step:
                rid, prompt_len, max_new, *_ = pending.pop(0)
                node.submit(rid, prompt_of(rid, prompt_len), max_new)
            for rid in node.in_transfer():
                seen.setdefault(rid, step)
            node.release({rid for rid, at in seen.items() if step - at >= delays[rid]})
            return bool(pending)

        await node.run(max_steps=20000, before_step=before_step)
        check_outputs(node.done, work["reqs"])
        retracted.append(node.engine.stats.retracted_reqs)
        service.pool.check_integrity(idle=True)

    @SEEDED
    @given(workloads(), st.sampled_from([0, 4, 8, 16]))
    def check(work: dict, reserve: int) -> None:
        # Victims wait in the host store while the rest grow: room for all of them.
        with pool_service(work["page"], work["num_pages"], host_pools=8) as service:
            asyncio.run(scenario(service, work, reserve))

    check()
    assert sum(map(bool, retracted)) >= 5, f"too few workloads retracted: {retracted}"
