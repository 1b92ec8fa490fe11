"""memsvc metrics: plain counters (for the ``stats`` op) and Prometheus, when enabled.

The pool's sizes are read at scrape time by a collector, so they cost the
request path nothing; per-op counters and latencies are cached label children.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memsvc.handlers import MemService

LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)


class Metrics:
    """Counters always; Prometheus series too when given a registry."""

    def __init__(self, registry: Any | None) -> None:
        self._counts: Counter[str] = Counter()
        self._registry = registry
        self._children: dict[tuple[str, str], tuple[Any, Any]] = {}
        if registry is None:
            return
        from prometheus_client import Counter as PromCounter
        from prometheus_client import Histogram

        self._ops = PromCounter(
            "memsvc_ops", "Requests handled, by op and result", ["op", "result"], registry=registry
        )
        self._latency = Histogram(
            "memsvc_op_seconds",
            "Time to handle one request, by op",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._retracted = PromCounter(
            "memsvc_retracted_reqs", "Requests retracted", registry=registry
        )
        self._offload_bytes = PromCounter(
            "memsvc_offload_bytes", "Bytes copied to the host store", registry=registry
        )
        self._load_bytes = PromCounter(
            "memsvc_load_bytes", "Bytes copied back from the host store", registry=registry
        )
        self._expired = PromCounter(
            "memsvc_sessions_expired", "Sessions whose lease ran out", registry=registry
        )
        self._retried = PromCounter(
            "memsvc_retried_ops", "Retried ops answered from the cache", registry=registry
        )

    def watch(self, service: MemService) -> None:
        """Export the pool's sizes, read when Prometheus scrapes."""
        if self._registry is None:
            return
        from prometheus_client.core import GaugeMetricFamily

        class PoolCollector:
            def collect(self) -> Any:
                pool = service.pool
                sizes = {
                    "capacity": pool.capacity,
                    "available": pool.available_size(),
                    "evictable": pool.evictable_size(),
                    "protected": pool.protected_size(),
                    "held": pool.held_size(),
                }
                tokens = GaugeMetricFamily(
                    "memsvc_tokens", "KV pool tokens by state", labels=["state"]
                )
                for state, value in sizes.items():
                    tokens.add_metric([state], value)
                yield tokens
                used = pool.capacity - pool.available_size() - pool.evictable_size()
                yield GaugeMetricFamily(
                    "memsvc_token_usage", "Fraction of the pool in use", value=used / pool.capacity
                )
                host = GaugeMetricFamily(
                    "memsvc_host_store_bytes", "Host store bytes", labels=["state"]
                )
                host.add_metric(["used"], pool.host_store.used_bytes)
                host.add_metric(["free"], pool.host_store.free_bytes)
                yield host
                yield GaugeMetricFamily(
                    "memsvc_sessions", "Live sessions", value=len(service.sessions)
                )
                yield GaugeMetricFamily(
                    "memsvc_open_requests", "Requests holding a row", value=len(pool.open_rids())
                )

        self._registry.register(PoolCollector())

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def op_done(self, op: str, result: str, seconds: float) -> None:
        self._counts[f"op.{op}.{result}"] += 1
        if self._registry is None:
            return
        children = self._children.get((op, result))
        if children is None:
            children = (self._ops.labels(op, result), self._latency.labels(op))
            self._children[(op, result)] = children
        children[0].inc()
        children[1].observe(seconds)

    def _add(self, name: str, amount: int, series: str) -> None:
        self._counts[name] += amount
        if self._registry is not None:
            getattr(self, series).inc(amount)

    def retracted(self, num_reqs: int) -> None:
        self._add("retracted_reqs", num_reqs, "_retracted")

    def offloaded(self, nbytes: int) -> None:
        self._add("offload_bytes", nbytes, "_offload_bytes")

    def loaded(self, nbytes: int) -> None:
        self._add("load_bytes", nbytes, "_load_bytes")

    def session_expired(self) -> None:
        self._add("sessions_expired", 1, "_expired")

    def retried_op(self) -> None:
        self._add("retried_ops", 1, "_retried")
