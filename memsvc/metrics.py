"""memsvc metrics: plain counters (for the ``stats`` op) and Prometheus, when enabled.

The request path only bumps plain Python counters: one count per (op, result)
and one latency bucket per op, a few dict and list operations. Prometheus
reads them, and the pool's sizes, when it scrapes, through a collector; a
prometheus-client ``observe`` per request would cost microseconds more on
every op.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memsvc.handlers import MemService

LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)


class OpLatency:
    """One op's latency histogram: a count per bucket (the last is +Inf) and the sum."""

    __slots__ = ("counts", "total_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le).
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total_s += seconds


class Metrics:
    """Counters always; exported to Prometheus too when given a registry."""

    def __init__(self, registry: Any | None) -> None:
        self._counts: Counter[str] = Counter()
        self._ops: dict[tuple[str, str], int] = {}
        self._latency: dict[str, OpLatency] = {}
        self._registry = registry

    def watch(self, service: MemService) -> None:
        """Export the counters and the pool's sizes, read when Prometheus scrapes."""
        if self._registry is None:
            return
        self._registry.register(_Collector(self, service))

    def counters(self) -> dict[str, int]:
        ops = {f"op.{op}.{result}": n for (op, result), n in list(self._ops.items())}
        return {**ops, **self._counts}

    def op_done(self, op: str, result: str, seconds: float) -> None:
        key = (op, result)
        ops = self._ops
        ops[key] = ops.get(key, 0) + 1
        latency = self._latency.get(op)
        if latency is None:
            latency = self._latency[op] = OpLatency()
        latency.observe(seconds)

    def retracted(self, num_reqs: int) -> None:
        self._counts["retracted_reqs"] += num_reqs

    def offloaded(self, nbytes: int) -> None:
        self._counts["offload_bytes"] += nbytes

    def loaded(self, nbytes: int) -> None:
        self._counts["load_bytes"] += nbytes

    def session_expired(self) -> None:
        self._counts["sessions_expired"] += 1

    def retried_op(self) -> None:
        self._counts["retried_ops"] += 1


# Plain counters exported as Prometheus counters: (series, help).
_COUNTER_SERIES = {
    "retracted_reqs": ("memsvc_retracted_reqs", "Requests retracted"),
    "offload_bytes": ("memsvc_offload_bytes", "Bytes copied to the host store"),
    "load_bytes": ("memsvc_load_bytes", "Bytes copied back from the host store"),
    "sessions_expired": ("memsvc_sessions_expired", "Sessions whose lease ran out"),
    "retried_ops": ("memsvc_retried_ops", "Retried ops answered from the cache"),
}


class _Collector:
    """Builds every memsvc series at scrape time (in the HTTP server's thread).

    The socket thread keeps changing the counters meanwhile: each dict and list
    is copied in one C-level step (``list(...)``) before it is read.
    """

    def __init__(self, metrics: Metrics, service: MemService) -> None:
        self.metrics = metrics
        self.service = service

    def collect(self) -> Any:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        metrics = self.metrics
        ops = CounterMetricFamily(
            "memsvc_ops", "Requests handled, by op and result", labels=["op", "result"]
        )
        for (op, result), count in list(metrics._ops.items()):
            ops.add_metric([op, result], count)
        yield ops
        latency = HistogramMetricFamily(
            "memsvc_op_seconds", "Time to handle one request, by op", labels=["op"]
        )
        bounds = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]
        for op, histogram in list(metrics._latency.items()):
            counts, total_s = list(histogram.counts), histogram.total_s
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([op], buckets, total_s)
        yield latency
        counts = dict(metrics._counts)
        for key, (name, doc) in _COUNTER_SERIES.items():
            yield CounterMetricFamily(name, doc, value=counts.get(key, 0))
        yield from self._pool_series(GaugeMetricFamily)
        yield from self._namespace_series(GaugeMetricFamily, CounterMetricFamily)
        if self.service.pool.hicache is not None:
            yield from self._hicache_series(GaugeMetricFamily, CounterMetricFamily)

    def _namespace_series(self, gauge: Any, counter: Any) -> Any:
        """Cache namespaces, the top ones by device tokens cached (``KVPool.namespace_stats``),
        labelled ``namespace=<namespace_label>``: a digest's prefix, never a salt."""
        stats = self.service.pool.namespace_stats()
        cached = gauge(
            "memsvc_namespace_cached_tokens",
            "Device tokens cached per cache namespace (top namespaces)",
            labels=["namespace"],
        )
        hits = counter(
            "memsvc_namespace_hit_tokens",
            "Prefix tokens matched per cache namespace and tier (top namespaces)",
            labels=["namespace", "tier"],
        )
        lookups = counter(
            "memsvc_namespace_lookup_tokens",
            "Tokens looked up in the prefix cache per cache namespace (top namespaces)",
            labels=["namespace"],
        )
        for label, row in stats.items():
            cached.add_metric([label], row["cached_tokens"])
            for tier in ("device", "host", "storage"):
                hits.add_metric([label, tier], row[f"{tier}_hit_tokens"])
            lookups.add_metric([label], row["lookup_tokens"])
        yield cached
        yield hits
        yield lookups

    def _hicache_series(self, gauge: Any, counter: Any) -> Any:
        """The hierarchical cache, under SGLang's ``sglang:hicache_*`` / ``load_back`` names
        where SGLang has the series, else ``kvstack_hicache_*``."""
        from prometheus_client.core import SummaryMetricFamily

        tree = self.service.pool.hicache
        s = tree.stats
        yield gauge(
            "sglang:hicache_host_used_tokens",
            "Tokens held in the hicache host tier",
            value=tree.host_used_tokens(),
        )
        yield gauge(
            "sglang:hicache_host_total_tokens",
            "Token capacity of the hicache host tier",
            value=tree.host_capacity_tokens(),
        )
        yield counter(
            "sglang:hicache_backup_bytes", "Bytes copied device -> host", value=s.backup_bytes
        )
        yield counter(
            "sglang:hicache_backup_tokens", "Tokens copied device -> host", value=s.backup_tokens
        )
        yield SummaryMetricFamily(
            "sglang:hicache_backup_duration_seconds",
            "Copy time of device -> host backups",
            count_value=s.backups,
            sum_value=s.backup_seconds,
        )
        yield counter(
            "sglang:hicache_dropped_tokens",
            "Tokens whose KV left every tier",
            value=s.dropped_tokens,
        )
        yield counter(
            "sglang:load_back_bytes", "Bytes loaded host / storage -> device", value=s.load_bytes
        )
        yield counter(
            "sglang:load_back_tokens", "Tokens loaded host / storage -> device", value=s.load_tokens
        )
        yield SummaryMetricFamily(
            "sglang:load_back_duration_seconds",
            "Copy time of host / storage -> device loads",
            count_value=s.loads,
            sum_value=s.load_seconds,
        )
        by_label = (
            ("kvstack_hicache_hit_tokens", "Prefix-match tokens by the tier they were found in",
             "tier", s.hit_tokens),
            ("kvstack_hicache_load_skips", "Off-device match parts recomputed, not loaded: under "
             "the load-back threshold or dearer to copy than to recompute (the cost model)",
             "reason", s.load_skips),
            ("kvstack_hicache_load_skip_tokens",
             "Tokens of the off-device match parts recomputed, not loaded",
             "reason", s.load_skip_tokens),
        )  # fmt: skip
        for name, text, label, values in by_label:
            family = counter(name, text, labels=[label])
            for key, value in dict(values).items():
                family.add_metric([key], value)
            yield family
        cost = tree.cost
        yield gauge(
            "kvstack_hicache_copy_bytes_per_second",
            "The load cost model's host -> device copy bandwidth (measured at start)",
            value=cost.copy_bytes_per_s,
        )
        yield gauge(
            "kvstack_hicache_recompute_seconds_per_token",
            "The load cost model's prefill time per token (0: not known yet)",
            value=cost.recompute_s_per_token or 0.0,
        )
        pool = self.service.pool
        usage = gauge("kvstack_hicache_usage", "Fraction of each tier in use", labels=["tier"])
        usage.add_metric(["device"], 1 - pool.available_size() / pool.capacity)
        usage.add_metric(["host"], tree.host_used_tokens() / max(tree.host_capacity_tokens(), 1))
        usage.add_metric(
            ["storage"], tree.storage_used_bytes() / max(tree.storage_capacity_bytes(), 1)
        )
        yield usage
        yield gauge(
            "kvstack_hicache_storage_used_bytes",
            "Bytes in the storage tier",
            value=tree.storage_used_bytes(),
        )
        yield gauge(
            "kvstack_hicache_storage_total_bytes",
            "Cap of the storage tier",
            value=tree.storage_capacity_bytes(),
        )
        yield counter(
            "kvstack_hicache_storage_write_bytes",
            "Bytes written host -> storage",
            value=s.storage_write_bytes,
        )
        yield counter(
            "kvstack_hicache_storage_written_bytes",
            "Bytes whose host -> storage write completed (storage_write_bytes are issued)",
            value=s.storage_written_bytes,
        )
        yield counter(
            "kvstack_hicache_storage_read_bytes",
            "Bytes read storage -> device",
            value=s.storage_read_bytes,
        )
        yield counter(
            "kvstack_hicache_storage_seconds",
            "Time spent in storage-tier I/O",
            value=s.storage_seconds,
        )
        yield counter(
            "kvstack_hicache_storage_load_failures",
            "Storage loads that met a missing, short, corrupt or unreadable page (a miss)",
            value=s.storage_load_failures,
        )
        yield counter(
            "kvstack_hicache_storage_write_failures",
            "Pages of storage backups undone by a failed write",
            value=s.storage_write_failures,
        )

    def _pool_series(self, gauge: Any) -> Any:
        service = self.service
        pool = service.pool
        sizes = {
            "capacity": pool.capacity,
            "available": pool.full_available_size(),  # the full pool's, hybrid or not
            "evictable": pool.evictable_size(),
            "protected": pool.protected_size(),
            "held": pool.held_size(),
        }
        tokens = gauge("memsvc_tokens", "KV pool tokens by state", labels=["state"])
        for state, value in sizes.items():
            tokens.add_metric([state], value)
        yield tokens
        used = pool.capacity - pool.full_available_size() - pool.evictable_size()
        yield gauge("memsvc_token_usage", "Fraction of the pool in use", value=used / pool.capacity)
        if pool.swa is not None:  # a hybrid model's SWA pool (SGLang: swa_token_usage)
            swa = gauge("memsvc_swa_tokens", "SWA pool tokens by state", labels=["state"])
            swa_used = pool.swa_capacity - pool.swa_available_size() - pool.swa_evictable_size()
            for state, value in (
                ("capacity", pool.swa_capacity),
                ("available", pool.swa_available_size()),
                ("evictable", pool.swa_evictable_size()),
                ("protected", pool.swa_protected_size()),
                ("held", pool.swa_held_size()),
                ("used", swa_used),
            ):
                swa.add_metric([state], value)
            yield swa
            yield gauge(
                "memsvc_swa_token_usage",
                "Fraction of the SWA pool in use",
                value=swa_used / pool.swa_capacity,
            )
        host = gauge("memsvc_host_store_bytes", "Host store bytes", labels=["state"])
        host.add_metric(["used"], pool.host_store.used_bytes)
        host.add_metric(["free"], pool.host_store.free_bytes)
        yield host
        yield gauge("memsvc_sessions", "Live sessions", value=len(service.sessions))
        yield gauge("memsvc_open_requests", "Requests holding a row", value=len(pool.open_rids()))
        yield gauge(
            "memsvc_pending_pages",
            "Freed pages waiting for an offload copy that may still read them",
            value=pool.allocator.num_pending_pages,
        )
