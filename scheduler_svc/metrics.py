"""Prometheus metrics of the scheduler, read from the engine when scraped.

Two sets side by side:

* kvstack's own, ``kvstack_*``: the retract counters (requests / input
  tokens / output tokens retracted, tokens re-prefilled; on a PD decode node,
  the requests moved to and from another decode node), the
  ``kvstack_num_retracted_reqs`` gauge (retracted by the last retract), the
  pool's tokens by state (a hybrid model's full pool; its SWA pool's in
  ``kvstack_swa_kv_tokens`` and ``kvstack_swa_token_usage``).
* SGLang's scheduler collector (``srt/observability/metrics_collector.py``),
  ``sglang:*``, with its names, meanings and labels (``model_name``,
  ``engine_type`` (unified / prefill / decode), ``tp_rank``, ``pp_rank``,
  ``moe_ep_rank``, and ``priority=""`` with priority scheduling), so that
  SGLang's Grafana dashboard queries work unchanged. Only the families
  kvstack can fill honestly: one scheduler, no tensor or pipeline
  parallelism (every rank label is 0), no speculative decoding, no LoRA.

The front's request families (``sglang:time_to_first_token_seconds``,
``sglang:prompt_tokens_total``...) are the HTTP front's
(:mod:`kvstack.serve.app`): a request is counted once, where it enters.

Token usage comes from the sizes memsvc put on its last reply. A hybrid
(sliding-window) model's pool is two pools: ``sglang:full_token_usage`` and
``sglang:swa_token_usage`` are each pool's, and ``sglang:token_usage`` and
``sglang:num_used_tokens`` the larger of the two, as SGLang reports them; the
``sglang:kv_*_tokens`` gauges stay the full pool's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from scheduler_svc.core.swa_budget import full_available_of
from scheduler_svc.engine import Engine

# SGLang's GEN_THROUGHPUT_STALENESS_SECONDS: a throughput measured longer ago than this
# is reported as 0 (no decode since).
GEN_THROUGHPUT_STALENESS_S = 30.0


def sglang_labels(model_name: str, engine_type: str, *, priority: bool = False) -> dict[str, str]:
    """The labels SGLang puts on every scheduler metric, for kvstack's single scheduler."""
    labels = {
        "model_name": model_name,
        "engine_type": engine_type,
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    if priority:
        labels["priority"] = ""  # SGLang: the total over all priorities
    return labels


ENGINE_TYPES = {"normal": "unified", "prefill": "prefill", "decode": "decode"}


def register(
    registry: Any,
    engine: Engine,
    *,
    model_name: str = "default",
    mode: str = "normal",
    max_context_len: int | None = None,
) -> None:
    """Register the scheduler's collector (both sets) on ``registry``."""
    labels = sglang_labels(
        model_name,
        ENGINE_TYPES[mode],
        priority=engine.config.enable_priority_scheduling,
    )
    registry.register(_Collector(engine, labels, max_context_len))


class _Collector:
    def __init__(self, engine: Engine, labels: dict[str, str], max_context_len: int | None):
        self.engine = engine
        self.labels = labels
        self.max_context_len = max_context_len

    def collect(self) -> Iterator[Any]:
        yield from self._kvstack()
        yield from self._sglang()

    # -- kvstack's own ---------------------------------------------------------------------

    def _kvstack(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.engine
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
        # A PD decode node's moves to / from another decode node (scheduler_svc.pd.migrate)
        for name, doc in [
            ("migrated_out_reqs", "Requests moved to the peer decode node"),
            (
                "migrated_from_row_reqs",
                "Of those, running requests sent straight from their pool pages (draining)",
            ),
            (
                "migrated_handed_off_reqs",
                "Of those, requests whose client was told where they moved (not relayed)",
            ),
            (
                "migrated_handed_off_reqs",
                "Of those, requests whose client was told where they moved (not relayed)",
            ),
            ("migrated_out_tokens", "KV tokens of the requests moved to the peer"),
            ("migrate_failed", "Moves to the peer that failed (the request stayed here)"),
            ("migrated_in_reqs", "Requests another decode node moved here"),
            (
                "migrate_waited_steps",
                "Steps the retracted head waited here: moving it would take longer",
            ),
        ]:
            if hasattr(stats, name):
                yield CounterMetricFamily(f"kvstack_{name}", doc, value=getattr(stats, name))
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
        pool = self._pool()
        if pool is not None:
            used, evictable, available, capacity = pool
            tokens = GaugeMetricFamily(
                "kvstack_kv_tokens", "KV pool tokens by state", labels=["state"]
            )
            tokens.add_metric(["used"], used)
            tokens.add_metric(["evictable"], evictable)
            tokens.add_metric(["available"], available)
            yield tokens
            yield GaugeMetricFamily(
                "kvstack_token_usage",
                "Fraction of the KV pool in use",
                value=used / capacity if capacity else 0.0,
            )
        swa = self._swa_pool()
        if swa is not None:
            used, evictable, available, capacity = swa
            tokens = GaugeMetricFamily(
                "kvstack_swa_kv_tokens",
                "SWA pool tokens by state (a hybrid model's sliding-window layers)",
                labels=["state"],
            )
            tokens.add_metric(["used"], used)
            tokens.add_metric(["evictable"], evictable)
            tokens.add_metric(["available"], available)
            yield tokens
            yield GaugeMetricFamily(
                "kvstack_swa_token_usage",
                "Fraction of the SWA pool in use",
                value=used / capacity if capacity else 0.0,
            )

    def _pool(self) -> tuple[int, int, int, int] | None:
        """(used, evictable, available, capacity) tokens, from memsvc's last reply: the
        full pool's (a hybrid pool's ``available`` is the smaller pool's free tokens)."""
        sizes = self.engine.mem.sizes
        if sizes is None:
            return None
        capacity = self.engine.capacity
        available = full_available_of(sizes)
        return (capacity - available - sizes.evictable, sizes.evictable, available, capacity)

    def _swa_pool(self) -> tuple[int, int, int, int] | None:
        """The SWA pool's (used, evictable, available, capacity) tokens; None unless the
        pool is hybrid and memsvc's last reply carried its sizes."""
        sizes = self.engine.mem.sizes
        spec = self.engine.swa if sizes is not None else None
        if spec is None or getattr(sizes, "swa_available", None) is None:
            return None
        available, evictable = int(sizes.swa_available), int(sizes.swa_evictable or 0)
        return (spec.capacity - available - evictable, evictable, available, spec.capacity)

    # -- SGLang's names ------------------------------------------------------------------------

    def _sglang(self) -> Iterator[Any]:
        engine = self.engine
        stats = engine.stats
        running = list(engine.running)
        gauges: list[tuple[str, str, float]] = [
            ("num_running_reqs", "The number of running requests.", len(running)),
            ("num_queue_reqs", "The number of requests in the waiting queue.", len(engine.waiting)),
            ("gen_throughput", "The generation throughput (token/s).", self._gen_throughput()),
            ("cache_hit_rate", "The prefix cache hit rate.", stats.last_cache_hit_rate),
            (
                "decode_sum_seq_lens",
                "The sum of all sequence lengths in decode.",
                sum(r.seq_len for r in running),
            ),
            ("new_token_ratio", "The new token ratio.", engine.ratio.current),
            ("num_retracted_reqs", "The number of retracted requests.", stats.last_retracted_reqs),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
             engine.capacity),
            ("page_size", "KV cache page size in tokens.", engine.config.page_size),
        ]  # fmt: skip
        if engine.capacity and engine.config.page_size:
            gauges.append(
                (
                    "num_pages",
                    "Number of KV cache pages.",
                    engine.capacity // engine.config.page_size,
                )
            )
        if self.max_context_len is not None:
            gauges.append(("context_len", "Maximum context length.", self.max_context_len))
        pool = self._pool()
        if pool is not None:
            used, evictable, available, capacity = pool
            usage = full_usage = used / capacity if capacity else 0.0
            num_used = used
            swa = self._swa_pool()
            if swa is not None:  # SGLang: the larger of the two pools'
                swa_used, _, _, swa_capacity = swa
                swa_usage = swa_used / swa_capacity if swa_capacity else 0.0
                usage, num_used = max(usage, swa_usage), max(used, swa_used)
                gauges.append(("swa_token_usage", "The token usage for SWA layers.", swa_usage))
            gauges += [
                ("token_usage", "The token usage.", round(usage, 2)),
                ("full_token_usage", "The token usage for full attention layers.", full_usage),
                ("num_used_tokens", "The number of used tokens.", num_used),
                (
                    "kv_available_tokens",
                    "Number of free token slots in the KV cache pool.",
                    available,
                ),
                (
                    "kv_evictable_tokens",
                    "Number of evictable (radix-cached) token slots in the KV cache pool.",
                    evictable,
                ),
                (
                    "kv_used_tokens",
                    "Number of actively used token slots in the KV cache pool.",
                    used,
                ),
            ]
        gauges += self._pd_queues()
        counters: list[tuple[str, str, float]] = [
            ("num_retracted_requests", "Total number of retracted requests.",
             stats.retracted_reqs),
            ("num_retracted_input_tokens", "Total number of retracted input tokens.",
             stats.retracted_input_tokens),
            ("num_retracted_output_tokens", "Total number of retracted output tokens.",
             stats.retracted_output_tokens),
        ]  # fmt: skip
        failed = getattr(stats, "transfer_failed", None)  # PD engines count it
        if failed is not None:
            counters.append(
                ("num_transfer_failed_reqs", "The number of transfer failed requests.", failed)
            )
        yield from self._families(gauges, counters)

    def _gen_throughput(self) -> float:
        """SGLang's gauge: the last window's decode tokens/s, 0 once it is stale."""
        stats = self.engine.stats
        at = stats.gen_throughput_at
        if at is None or time.monotonic() - at > GEN_THROUGHPUT_STALENESS_S:
            return 0.0
        return stats.last_gen_throughput

    def _pd_queues(self) -> list[tuple[str, str, float]]:
        """The PD queue gauges of the engine's role (SGLang's names; none in normal mode)."""
        engine = self.engine
        out = []
        for attr, name, doc in [
            ("inflight", "num_prefill_inflight_queue_reqs",
             "The number of requests in the prefill inflight queue."),
            ("prealloc", "num_decode_prealloc_queue_reqs",
             "The number of requests in the decode prealloc queue."),
            ("transfer", "num_decode_transfer_queue_reqs",
             "The number of requests in the decode transfer queue."),
        ]:  # fmt: skip
            queue = getattr(engine, attr, None)
            if queue is not None:
                out.append((name, doc, len(queue)))
        return out

    def _families(
        self, gauges: list[tuple[str, str, float]], counters: list[tuple[str, str, float]]
    ) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())
        for kind, items in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, value in items:
                family = kind(f"sglang:{name}", doc, labels=names)
                family.add_metric(values, value)
                yield family
