"""One sampling record (issue 27, item 3): the wire's schema is declared once.

Every field of :class:`model_svc.protocol.Sampling` is a field of the
scheduler's ``GenSampling`` and of the worker's ``SamplingSpec``, and the
scheduler hands it to the worker as the client sent it: a new field needs no
copy on the way (only the sampler that honours it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from memsvc.handlers import MemService
from model_svc.protocol import Sampling, SamplingSpec
from scheduler_svc.core import Req, SamplingParams, SchedulerConfig
from scheduler_svc.engine import Engine
from scheduler_svc.protocol import GenSampling
from tests.helpers import pool_service
from tests.scheduler.engine_harness import FakeModel, InProcessMem

PAGE = 4
# A value other than the default for the fields known today; any other field keeps its
# default, which must reach the worker too.
NON_DEFAULT = {"temperature": 0.5, "top_p": 0.75, "top_k": 3, "min_p": 0.25, "seed": 7}


def draw_values() -> dict:
    return {
        name: NON_DEFAULT.get(name, field.get_default(call_default_factory=True))
        for name, field in Sampling.model_fields.items()
    }


class RecordingModel(FakeModel):
    """FakeModel's tokens; keeps every sampling list it is sent."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__(table)
        self.sent: list = []

    async def extend(self, items, sampling=None, pool_epoch=None, **logprob_args):
        self.sent.append(sampling)
        return await super().extend(items, sampling, pool_epoch)

    async def decode(self, rows, seq_lens, token_ids, sampling=None, pool_epoch=None):
        self.sent.append(sampling)
        return await super().decode(rows, seq_lens, token_ids, sampling, pool_epoch)


@pytest.fixture
def service() -> Iterator[MemService]:
    with pool_service(PAGE) as svc:
        yield svc


def test_both_wires_take_every_field_of_the_one_schema() -> None:
    fields = set(Sampling.model_fields)
    assert fields <= set(GenSampling.model_fields)
    assert fields <= set(SamplingSpec.model_fields)
    for name in fields:  # one declaration: the same default and bounds everywhere
        one = Sampling.model_fields[name]
        for wire in (GenSampling, SamplingSpec):
            field = wire.model_fields[name]
            assert (field.default, field.metadata) == (one.default, one.metadata)


def test_the_scheduler_keeps_the_record_and_the_worker_gets_it(service: MemService) -> None:
    values = draw_values()
    record = GenSampling(max_new_tokens=3, stop=["zz"], stop_token_ids=[5, 5], **values)
    params = SamplingParams.of(record.model_dump(), max_new_tokens=2)
    # The limits the core enforces, by name (``decided`` wins); the rest kept whole.
    assert params.max_new_tokens == 2
    assert params.stop == ("zz",) and params.stop_token_ids == frozenset({5})
    assert params.draw == values

    async def run() -> list:
        mem = await InProcessMem.connect(service)
        model = RecordingModel(service.pool.table.array)
        config = SchedulerConfig(page_size=PAGE, max_running_requests=4)
        engine = Engine(config, mem, model, lambda req, finished: None, capacity=64)
        engine.submit(Req("r", [3] * 9, params))
        for _ in range(100):
            if not await engine.step() and engine.idle:
                break
        return model.sent

    sent = asyncio.run(run())
    assert len(sent) == 2  # the prefill, then one decode step
    for specs in sent:
        (spec,) = [SamplingSpec.model_validate(s) for s in specs]
        assert spec.model_dump(include=set(values)) == values


def test_a_seed_of_0_is_drawn_from_the_rid(service: MemService) -> None:
    async def run() -> list:
        mem = await InProcessMem.connect(service)
        model = RecordingModel(service.pool.table.array)
        config = SchedulerConfig(page_size=PAGE, max_running_requests=4)
        engine = Engine(config, mem, model, lambda req, finished: None, capacity=64)
        for rid in ("a", "b"):
            record = GenSampling(max_new_tokens=1, temperature=1.0)
            engine.submit(Req(rid, [3] * 5, SamplingParams.of(record.model_dump())))
        for _ in range(100):
            if not await engine.step() and engine.idle:
                break
        return [spec for specs in model.sent for spec in specs]

    seeds = [spec["seed"] for spec in asyncio.run(run())]
    assert len(seeds) == 2 and 0 not in seeds and seeds[0] != seeds[1]
