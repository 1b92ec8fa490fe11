"""Prometheus metrics of the scheduler, read from the engine when scraped.

Names and meanings follow SGLang's (``sglang:num_retracted_reqs`` and
friends) with a ``kvstack_`` prefix: the gauge is the number retracted by the
last retract, the counters total requests / input tokens / output tokens
retracted. Token usage comes from the sizes memsvc put on its last reply.
"""

from __future__ import annotations

from typing import Any

from scheduler_svc.engine import Engine


def register(registry: Any, engine: Engine) -> None:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class SchedulerCollector:
        def collect(self) -> Any:
            stats = engine.stats
            yield GaugeMetricFamily(
                "kvstack_num_retracted_reqs",
                "Requests retracted by the last retract",
                value=stats.last_retracted_reqs,
            )
            for name, doc, value in [
                ("retracted_reqs", "Requests retracted", stats.retracted_reqs),
                (
                    "retracted_input_tokens",
                    "Prompt tokens of retracted requests",
                    stats.retracted_input_tokens,
                ),
                (
                    "retracted_output_tokens",
                    "Output tokens of retracted requests",
                    stats.retracted_output_tokens,
                ),
                (
                    "reprefilled_tokens",
                    "Tokens computed again after a retract",
                    stats.reprefilled_tokens,
                ),
                ("generated_tokens", "Output tokens generated", stats.generated_tokens),
                ("aborted_reqs", "Requests aborted", stats.aborted_reqs),
                ("finished_reqs", "Requests finished", stats.finished_reqs),
            ]:
                yield CounterMetricFamily(f"kvstack_{name}", doc, value=value)
            yield GaugeMetricFamily(
                "kvstack_new_token_ratio", "Admission's new_token_ratio", value=engine.ratio.current
            )
            yield GaugeMetricFamily(
                "kvstack_num_running_reqs",
                "Requests in the decode batch",
                value=len(engine.running),
            )
            yield GaugeMetricFamily(
                "kvstack_num_queue_reqs",
                "Requests waiting (new or retracted)",
                value=len(engine.waiting),
            )
            sizes = engine.mem.sizes
            if sizes is not None:
                capacity = engine.capacity
                used = capacity - sizes.available - sizes.evictable
                tokens = GaugeMetricFamily(
                    "kvstack_kv_tokens", "KV pool tokens by state", labels=["state"]
                )
                tokens.add_metric(["used"], used)
                tokens.add_metric(["evictable"], sizes.evictable)
                tokens.add_metric(["available"], sizes.available)
                yield tokens
                yield GaugeMetricFamily(
                    "kvstack_token_usage",
                    "Fraction of the KV pool in use",
                    value=used / capacity if capacity else 0.0,
                )

    registry.register(SchedulerCollector())
