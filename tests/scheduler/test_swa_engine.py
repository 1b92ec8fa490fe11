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

from memsvc.core import KVPool
from memsvc.handlers import MemService, ServiceConfig
from scheduler_svc.core.swa_budget import SwaSizes, SwaSpec
from scheduler_svc.engine import prefill_round
from tests.helpers import pool_service, small_layout
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
        # not parked (no decode would ever free SWA pages): one page (sglang-differences 34)
        assert req.kv_len == 12
        await h.run()
        assert h.done["long"].output_ids == expected_output(prompt, 4)
        assert req.finish_reason is not None
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


@pytest.mark.parametrize("chunk", [None, 8])
def test_on_a_hybrid_pool_every_request_finishes_exactly(monkeypatch, chunk) -> None:
    """memsvc's own two pools (W = 8, 20 SWA pages against 64 full ones): the SWA gate keeps
    admission within what memsvc can allocate (no allocation of an admitted batch fails,
    as it does when only the full pool is budgeted) and every output is exact.

    The SWA numbers are read off the pool as memsvc's replies carry them
    (``full_available``, ``swa_available``, ``swa_evictable``)."""
    from scheduler_svc.core.swa_budget import swa_spec_of
    from scheduler_svc.core.swa_intake import check_swa_fits

    layout = small_layout(
        page_size=PAGE,
        layer_types=("full_attention", "sliding_attention"),
        sliding_window=8,
        swa_num_pages=20,
    )
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    service = MemService(pool, ServiceConfig(retract_decode_steps=20))
    spec = swa_spec_of(layout)
    monkeypatch.setattr(prefill_round, "full_available_of", lambda s: pool.full_available_size())

    async def scenario() -> None:
        h = await Harness(service, chunked_prefill_size=chunk).start()
        h.engine.swa_budget_inputs = lambda sizes: (
            spec,
            SwaSizes(pool.swa_available_size(), pool.swa_evictable_size()),
        )
        failed = []
        alloc_extend = h.mem.alloc_extend

        async def counted(*args, **kwargs):
            result = await alloc_extend(*args, **kwargs)
            failed.extend([] if result.fits else [args[0]])
            return result

        h.mem.alloc_extend = counted
        prompts = {}
        for i in range(8):
            prompt = [i + 2] * (6 + 2 * i)
            check_swa_fits(len(prompt), spec, mode="normal", chunked_prefill_size=chunk)
            prompts[f"r{i}"] = prompt
            h.submit(f"r{i}", prompt, 10)
        await h.engine.step()
        # the full pool alone takes all 8 in the first round (Σ ceil_page(prompt) + page + 10
        # = 232 < 256); the SWA gate 5: reservations 12 + 12 + 16 + 16 + 20 = 76, + 20 >= 80
        assert len(h.engine.running) + (h.engine.chunked is not None) <= 5
        await h.run()
        assert failed == []
        for rid, prompt in prompts.items():
            assert h.done[rid].output_ids == expected_output(prompt, 10), rid
        pool.check_integrity(idle=True)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("window", "swa_pages", "chunk", "refused"),
    [
        (8, 4, 4, False),  # was stuck at kv_len 16: the window's pages were freed after
        (8, 4, 8, False),  # was stuck at kv_len 12: the whole chunk could never fit
        (8, 5, 4, False),
        (8, 6, 8, False),
        (8, 4, 16, False),
        (8, 3, 4, True),  # a page-sized chunk and its window: 2 x 4 + 8 = 16 > 12
        (8, 4, None, True),  # unchunked, 40 + 8 + 4 = 52 >= 16
        (8, 16, None, False),
        (16, 5, 4, True),  # 2 x 4 + 16 = 24 > 20
        (16, 6, 4, False),
        (16, 6, 32, False),
    ],
)
def test_a_chunked_prefill_on_a_small_swa_pool_finishes_or_is_refused(
    window, swa_pages, chunk, refused
) -> None:
    """memsvc's own two pools, one 40-token prompt alone: what intake accepts finishes
    with the exact output (memsvc frees the window's out-of-window SWA pages before it
    allocates; with nothing running, a chunk the SWA budget would park goes on one page
    at a time); what could never progress is refused at intake (400)."""
    from scheduler_svc.core.errors import RequestTooLargeError
    from scheduler_svc.core.swa_budget import swa_spec_of
    from scheduler_svc.core.swa_intake import check_swa_fits

    layout = small_layout(
        page_size=PAGE,
        layer_types=("full_attention", "sliding_attention"),
        sliding_window=window,
        swa_num_pages=swa_pages,
    )
    spec = swa_spec_of(layout)
    prompt, max_new = [5] * 40, 10
    if refused:
        with pytest.raises(RequestTooLargeError, match="SWA") as err:
            check_swa_fits(
                len(prompt),
                spec,
                mode="normal",
                chunked_prefill_size=chunk,
                max_new_tokens=max_new,
            )
        assert err.value.status_code == 400
        return
    check_swa_fits(
        len(prompt), spec, mode="normal", chunked_prefill_size=chunk, max_new_tokens=max_new
    )
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    service = MemService(pool, ServiceConfig(retract_decode_steps=20))

    async def scenario() -> None:
        h = await Harness(service, chunked_prefill_size=chunk).start()
        assert h.engine.swa == spec  # from memsvc's layout, as memsvc's replies feed the gate
        h.submit("a", prompt, max_new)
        for _ in range(200):  # 40 one-page chunks and 10 decode steps at most
            await h.engine.step()
            if "a" in h.done:
                break
        assert "a" in h.done, (
            f"lost: kv_len {getattr(h.engine.chunked, 'kv_len', None)}, "
            f"running {len(h.engine.running)}, waiting {len(h.engine.waiting)}"
        )
        assert h.done["a"].output_ids == expected_output(prompt, max_new)
        pool.check_integrity(idle=True)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("window", "swa_pages", "chunk", "extra"),
    [
        (8, 4, 4, 5),  # was lost: the prefix's pinned SWA tail left 8 < 0 + 8 + 4, forever
        (8, 4, 8, 5),
        (8, 4, 4, 13),
        (16, 6, 4, 5),
        (16, 7, None, 1),  # unchunked: 0 + min(2 + 6, 16) + 4 = 14 >= 28 - 16 pinned
        (16, 8, None, 5),
    ],
)
def test_a_cached_prefix_request_alone_on_a_small_swa_pool_finishes(
    window, swa_pages, chunk, extra
) -> None:
    """A request whose prefix is cached, alone on a small SWA pool, is admitted and finishes
    with the exact output: its prefix lock pins the cached SWA tail, so the SWA gate's
    shortfall is not transient (nothing running will free a page) and admission does not
    wait for it (issue 29: "b" waited forever behind its own prefix)."""
    from scheduler_svc.core.swa_budget import swa_spec_of
    from scheduler_svc.core.swa_intake import check_swa_fits

    layout = small_layout(
        page_size=PAGE,
        layer_types=("full_attention", "sliding_attention"),
        sliding_window=window,
        swa_num_pages=swa_pages,
    )
    spec = swa_spec_of(layout)
    max_new = 6
    prompts = {"a": [5] * 17, "b": [5] * 17 + [7] * extra}
    for prompt in prompts.values():  # intake accepts both (the cases are chosen so)
        check_swa_fits(
            len(prompt), spec, mode="normal", chunked_prefill_size=chunk, max_new_tokens=max_new
        )
    pool = KVPool(layout, host_store_bytes=layout.kv_bytes)
    service = MemService(pool, ServiceConfig(retract_decode_steps=20))

    async def scenario() -> None:
        h = await Harness(service, chunked_prefill_size=chunk).start()
        for rid, prompt in prompts.items():
            h.submit(rid, prompt, max_new)
            for _ in range(100):  # 40 one-page chunks and 6 decode steps at most
                await h.engine.step()
                if rid in h.done:
                    break
            assert rid in h.done, (
                f"{rid} lost: kv_len {getattr(h.engine.chunked, 'kv_len', None)}, "
                f"running {len(h.engine.running)}, waiting {len(h.engine.waiting)}"
            )
            assert h.done[rid].output_ids == expected_output(prompt, max_new), rid
        pool.check_integrity(idle=True)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
