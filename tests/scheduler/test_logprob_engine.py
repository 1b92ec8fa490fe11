"""Logprob bookkeeping in the scheduling loop (SGLang's return_logprob), with a fake model.

The fake model gives every logprob as a function of the position it scores, so the
tests can tell exactly which positions a request's lists hold: across chunked
prefills and retracts (normal mode) nothing may be lost or counted twice, a
prompt position inside a cached prefix is never asked for (the prefix match
stops at ``logprob_start_len``, as SGLang's), and the lists come out in
SGLang's shape (the first prompt entry None, the sampling position dropped).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.handlers import MemService
from model_svc.client import ForwardResult
from scheduler_svc.core import Req, SamplingParams, SchedulerConfig
from scheduler_svc.engine import Engine
from tests.helpers import pool_service
from tests.scheduler.engine_harness import FakeModel, InProcessMem, expected_output

PAGE = 4


def out_lp(position: int) -> float:
    """The logprob the fake gives a token sampled to sit at ``position``."""
    return -(position + 1) / 1000


def in_lp(position: int) -> float:
    """The logprob the fake gives the prompt token after ``position``."""
    return -10.0 - position


class LogprobModel(FakeModel):
    """FakeModel's tokens, with logprobs that name the position they score."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__(table)
        self.input_positions: list[int] = []  # every prompt position asked for, all calls

    async def extend(
        self, items, sampling=None, pool_epoch=None, logprob_starts=None, next_token_ids=None
    ):
        result = await super().extend(items, sampling, pool_epoch)
        ends = [prefix + len(new) for _, prefix, new in items]
        inputs = None
        if logprob_starts is not None:
            inputs = []
            for (_, prefix, new), start in zip(items, logprob_starts, strict=True):
                positions = list(range(prefix + start, prefix + len(new)))
                self.input_positions += positions
                inputs.append(
                    {
                        "logprobs": [in_lp(p) for p in positions],
                        "top": [[[in_lp(p)], [7]] for p in positions],
                    }
                    if positions
                    else None
                )
        return self._with_logprobs(result, ends, sampling, inputs)

    async def decode(self, rows, seq_lens, token_ids, sampling=None, pool_epoch=None):
        result = await super().decode(rows, seq_lens, token_ids, sampling, pool_epoch)
        return self._with_logprobs(result, [int(s) for s in seq_lens], sampling, None)

    @staticmethod
    def _with_logprobs(result, positions, sampling, inputs) -> ForwardResult:
        specs = sampling or [{}] * len(positions)
        logprobs = [
            out_lp(p) if s.get("logprobs") else None for p, s in zip(positions, specs, strict=True)
        ]
        tops = [
            [[out_lp(p), out_lp(p) - 1], [int(t), 0]] if s.get("top_logprobs_num") else None
            for p, s, t in zip(positions, specs, result.next_token_ids.tolist(), strict=True)
        ]
        return ForwardResult(result.next_token_ids, logprobs, tops, inputs)


@pytest.fixture
def service() -> Iterator[MemService]:
    with pool_service(PAGE) as svc:
        yield svc


async def start(service: MemService, **config) -> tuple[Engine, dict[str, Req], LogprobModel]:
    done: dict[str, Req] = {}
    mem = await InProcessMem.connect(service)
    model = LogprobModel(service.pool.table.array)
    fields = dict(page_size=PAGE, max_running_requests=16)
    engine = Engine(
        SchedulerConfig(**{**fields, **config}),
        mem,
        model,
        lambda req, finished: done.__setitem__(req.rid, req) if finished else None,
        capacity=service.pool.capacity,
    )
    return engine, done, model


def logprob_req(rid: str, prompt: list[int], max_new: int, start: int, top: int = 0) -> Req:
    return Req(
        rid,
        prompt,
        SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0}),
        return_logprob=True,
        logprob_start_len=len(prompt) if start < 0 else start,
        top_logprobs_num=top,
    )


async def run_idle(engine: Engine) -> None:
    for _ in range(3000):
        if not await engine.step() and engine.idle:
            return
    raise AssertionError("the engine did not go idle")


def expected_input(prompt: list[int], start: int) -> list[float | None]:
    return [None] + [in_lp(p) for p in range(start, len(prompt) - 1)]


def test_retracts_and_chunks_neither_lose_nor_repeat_logprobs(service) -> None:
    async def scenario() -> None:
        engine, done, _ = await start(
            service, test_retract=True, test_retract_interval=2, chunked_prefill_size=8
        )
        prompts = {f"r{i}": [i + 1] * (5 + 4 * i) for i in range(6)}
        starts = {rid: (i * 3) % len(p) for i, (rid, p) in enumerate(prompts.items())}
        for rid, prompt in prompts.items():
            engine.submit(logprob_req(rid, prompt, 12, starts[rid], top=2))
        await run_idle(engine)
        assert engine.stats.retracted_reqs > 0
        for rid, prompt in prompts.items():
            req = done[rid]
            assert req.output_ids == expected_output(prompt, 12), rid
            state = req.logprob
            # One per output token, each of the position it sits at: none lost or twice.
            assert state.output_vals == [out_lp(len(prompt) + i) for i in range(12)], rid
            assert [top[0][0] for top in state.output_tops] == state.output_vals
            assert state.input_done
            assert state.input_vals == expected_input(prompt, starts[rid]), rid
            assert state.input_tops[0] is None
            assert [t[0][0] for t in state.input_tops[1:]] == state.input_vals[1:]
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_the_prefix_match_stops_at_logprob_start_len(service) -> None:
    async def scenario() -> None:
        engine, done, model = await start(service)
        prompt = list(range(1, 26))
        plain = Req("warm", prompt, SamplingParams(max_new_tokens=2, draw={"temperature": 0.0}))
        engine.submit(plain)
        await run_idle(engine)
        assert done["warm"].cached_tokens == 0
        # The tree holds the prompt now: a plain request hits it ...
        engine.submit(
            Req("hit", prompt, SamplingParams(max_new_tokens=2, draw={"temperature": 0.0}))
        )
        await run_idle(engine)
        assert done["hit"].cached_tokens == 24
        # ... one asking for the prompt's logprobs from 0 recomputes it all ...
        model.input_positions.clear()
        engine.submit(logprob_req("all", prompt, 2, 0))
        await run_idle(engine)
        assert done["all"].cached_tokens == 0
        assert model.input_positions == list(range(25))
        assert done["all"].logprob.input_vals == expected_input(prompt, 0)
        # ... one from 10 reuses the pages below it (page-aligned: 8 tokens).
        model.input_positions.clear()
        engine.submit(logprob_req("part", prompt, 2, 10))
        await run_idle(engine)
        assert done["part"].cached_tokens == 8
        assert model.input_positions == list(range(10, 25))
        assert done["part"].logprob.input_vals == expected_input(prompt, 10)
        # Output logprobs only (logprob_start_len -1): the whole prefix is reused.
        model.input_positions.clear()
        engine.submit(logprob_req("out", prompt, 2, -1))
        await run_idle(engine)
        assert done["out"].cached_tokens == 24 and model.input_positions == []
        assert done["out"].logprob.input_vals == []
        assert done["out"].logprob.output_vals == [out_lp(25), out_lp(26)]
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_without_return_logprob_nothing_is_asked_or_kept(service) -> None:
    async def scenario() -> None:
        engine, done, model = await start(service)
        engine.submit(
            Req("r", [3] * 9, SamplingParams(max_new_tokens=4, draw={"temperature": 0.0}))
        )
        await run_idle(engine)
        assert model.input_positions == []
        assert done["r"].logprob.output_vals == [] and done["r"].logprob.input_vals == []
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())
