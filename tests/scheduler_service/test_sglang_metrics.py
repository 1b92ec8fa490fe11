"""The scheduler's metrics under SGLang's names: an in-process engine, scraped as Prometheus would.

The exposition goes through prometheus_client's own parser; SGLang's
scheduler families must be there with SGLang's types and labels, next to
kvstack's own, and their values must follow the work the engine did.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from memsvc.handlers import MemService
from scheduler_svc import metrics
from scheduler_svc.core import Req, SamplingParams, SchedulerConfig
from scheduler_svc.engine import GEN_THROUGHPUT_PASSES, Engine
from tests.helpers import pool_service
from tests.scheduler.engine_harness import FakeModel, InProcessMem

PAGE = 4
LABELS = {
    "model_name": "smol",
    "engine_type": "unified",
    "tp_rank": "0",
    "pp_rank": "0",
    "moe_ep_rank": "0",
}
GAUGES = [
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:decode_sum_seq_lens",
    "sglang:new_token_ratio",
    "sglang:num_retracted_reqs",
    "sglang:max_total_num_tokens",
    "sglang:page_size",
    "sglang:num_pages",
    "sglang:context_len",
    "sglang:token_usage",
    "sglang:full_token_usage",
    "sglang:num_used_tokens",
    "sglang:kv_available_tokens",
    "sglang:kv_evictable_tokens",
    "sglang:kv_used_tokens",
]
COUNTERS = [
    "sglang:num_retracted_requests",
    "sglang:num_retracted_input_tokens",
    "sglang:num_retracted_output_tokens",
]


@pytest.fixture
def service() -> Iterator[MemService]:
    with pool_service(PAGE) as svc:
        yield svc


async def start_engine(service: MemService, **config) -> Engine:
    mem = await InProcessMem.connect(service)
    fields = dict(page_size=PAGE, max_running_requests=16, **config)
    return Engine(
        SchedulerConfig(**fields),
        mem,
        FakeModel(service.pool.table.array),
        lambda req, finished: None,
        capacity=service.pool.capacity,
    )


def scrape(registry: CollectorRegistry) -> dict[str, object]:
    """Families by name, parsed back from the text exposition."""
    text = generate_latest(registry).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, name: str, labels: dict[str, str] = LABELS) -> float:
    """The one sample called ``name`` (a counter's ``_total``) with exactly ``labels``."""
    (sample,) = [
        s
        for family in families.values()
        for s in family.samples
        if s.name == name and s.labels == labels
    ]
    return sample.value


def submit(engine: Engine, rid: str, prompt: list[int], max_new: int) -> None:
    engine.submit(
        Req(rid, prompt, SamplingParams(max_new_tokens=max_new, draw={"temperature": 0.0}))
    )


async def run_idle(engine: Engine) -> None:
    for _ in range(5000):
        if not await engine.step() and engine.idle:
            return
    raise AssertionError("the engine did not go idle")


def test_sglang_families_have_sglangs_types_labels_and_follow_the_work(service) -> None:
    async def scenario() -> None:
        engine = await start_engine(service, test_retract=True, test_retract_interval=3)
        registry = CollectorRegistry()
        metrics.register(registry, engine, model_name="smol", max_context_len=512)
        families = scrape(registry)
        for name in GAUGES:
            assert families[name].type == "gauge", name
            assert [s.labels for s in families[name].samples] == [LABELS], name
        for name in COUNTERS:
            assert families[name].type == "counter", name
            assert value(families, f"{name}_total") == 0, name
        assert value(families, "sglang:max_total_num_tokens") == service.pool.capacity
        assert value(families, "sglang:num_pages") == 64
        assert value(families, "sglang:page_size") == PAGE
        assert value(families, "sglang:context_len") == 512
        assert value(families, "sglang:num_running_reqs") == 0
        assert value(families, "sglang:gen_throughput") == 0
        # kvstack's own families stay alongside
        assert families["kvstack_retracted_reqs"].type == "counter"

        shared = list(range(1, 17))  # four pages: a cache hit for the second wave
        for i in range(4):
            submit(engine, f"a{i}", [*shared, 100 + i], GEN_THROUGHPUT_PASSES + 10)
        for _ in range(6):
            await engine.step()
        busy = scrape(registry)
        running = len(engine.running)
        assert running > 0
        assert value(busy, "sglang:num_running_reqs") == running
        assert value(busy, "sglang:num_queue_reqs") == len(engine.waiting)
        assert value(busy, "sglang:decode_sum_seq_lens") == sum(r.seq_len for r in engine.running)
        used = value(busy, "sglang:num_used_tokens")
        assert used > 0
        assert value(busy, "sglang:kv_used_tokens") == used
        assert value(busy, "sglang:token_usage") == round(used / service.pool.capacity, 2)
        await run_idle(engine)

        done = scrape(registry)
        stats = engine.stats
        assert stats.retracted_reqs > 0
        assert value(done, "sglang:num_retracted_requests_total") == stats.retracted_reqs
        assert value(done, "sglang:num_retracted_input_tokens_total") == (
            stats.retracted_input_tokens
        )
        assert value(done, "sglang:num_retracted_output_tokens_total") == (
            stats.retracted_output_tokens
        )
        assert value(done, "sglang:gen_throughput") > 0  # measured over 40 decode passes
        assert value(done, "sglang:num_running_reqs") == 0
        assert value(done, "sglang:num_used_tokens") == 0

        # A prompt sharing the first four pages hits the cache: the gauge says how much.
        submit(engine, "b", [*shared, 200], 2)
        await run_idle(engine)
        hit = value(scrape(registry), "sglang:cache_hit_rate")
        assert hit == pytest.approx(16 / 17)
        assert engine.stats.cached_tokens >= 16
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_priority_scheduling_adds_sglangs_priority_label_and_pd_roles_name_the_engine(
    service,
) -> None:
    async def scenario() -> None:
        engine = await start_engine(
            service, enable_priority_scheduling=True, retraction_policy="priority"
        )
        registry = CollectorRegistry()
        metrics.register(registry, engine, model_name="m", mode="decode")
        labels = {**LABELS, "model_name": "m", "engine_type": "decode", "priority": ""}
        families = scrape(registry)
        assert value(families, "sglang:num_queue_reqs", labels) == 0
        assert "sglang:num_decode_transfer_queue_reqs" not in families  # not a PD engine
        # what DecodeEngine adds: its queues and its failed-transfer count
        engine.prealloc, engine.transfer = deque(["r1", "r2"]), {7: "r3"}
        engine.stats.transfer_failed = 3
        families = scrape(registry)
        assert value(families, "sglang:num_decode_prealloc_queue_reqs", labels) == 2
        assert value(families, "sglang:num_decode_transfer_queue_reqs", labels) == 1
        assert value(families, "sglang:num_transfer_failed_reqs_total", labels) == 3
        assert "kvstack_migrated_out_reqs_total" not in families  # not a decode engine
        engine.stats.migrated_out_reqs, engine.stats.migrated_in_reqs = 4, 2
        engine.stats.migrate_waited_steps = 5
        families = scrape(registry)
        assert value(families, "kvstack_migrated_out_reqs_total", {}) == 4
        assert value(families, "kvstack_migrated_in_reqs_total", {}) == 2
        assert value(families, "kvstack_migrate_waited_steps_total", {}) == 5
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())


def test_gen_throughput_goes_stale_as_sglangs(service, monkeypatch) -> None:
    async def scenario() -> None:
        engine = await start_engine(service)
        registry = CollectorRegistry()
        metrics.register(registry, engine, model_name="smol")
        submit(engine, "r", [1, 2, 3], GEN_THROUGHPUT_PASSES + 5)
        await run_idle(engine)
        assert value(scrape(registry), "sglang:gen_throughput") > 0
        at = engine.stats.gen_throughput_at
        monkeypatch.setattr(
            metrics.time, "monotonic", lambda: at + metrics.GEN_THROUGHPUT_STALENESS_S + 1
        )
        assert value(scrape(registry), "sglang:gen_throughput") == 0
        service.pool.check_integrity(idle=True)

    asyncio.run(scenario())
