"""The front's metrics: its own series, SGLang's request metrics, and ``/metrics``'s merge.

:class:`FrontMetrics` counts what the front answers and measures SGLang's
tokenizer-side request metrics under SGLang's names (:class:`SGLangMetrics`);
:class:`Scraper` reads the services' expositions, and :func:`merge_metrics`
makes all of them one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from aiohttp import ClientError, ClientSession, ClientTimeout

log = logging.getLogger("kvstack.http")

SCRAPE_TIMEOUT_S = 3.0


def parse_metrics(text: str) -> list[Any]:
    """The metric families of a Prometheus text exposition; ValueError if it is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def merge_metrics(sources: Sequence[tuple[str, list[Any]]]) -> bytes:
    """One exposition from several: ``(service, families)`` pairs (see :func:`parse_metrics`).

    Families of the same name from different sources (two memsvcs in PD mode)
    become one family with one HELP and one TYPE line, their samples told
    apart by a ``service`` label; a family whose type disagrees with the
    first source's is dropped (and logged) rather than making the whole
    exposition unparsable.
    """
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric

    families: dict[str, Metric] = {}
    for service, found in sources:
        for family in found:
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            elif merged.type != family.type:
                log.warning(
                    "metric %s is a %s in %s but a %s elsewhere; dropped from %s",
                    family.name,
                    family.type,
                    service,
                    merged.type,
                    service,
                )
                continue
            for sample in family.samples:
                labels = {"service": service, **sample.labels}
                merged.samples.append(sample._replace(labels=labels))

    class Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    return generate_latest(Merged())  # type: ignore[arg-type]


class FrontMetrics:
    """The front's own series: requests by endpoint and status, generate latency, in flight;
    and SGLang's request metrics (:class:`SGLangMetrics`)."""

    def __init__(self, model_name: str = "default", engine_type: str = "unified") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvstack_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.generate_seconds = Histogram(
            "kvstack_http_generate_seconds",
            "Time of each request to the scheduler, from sending it to its result or end (a "
            "batch, or n > 1, sends several)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.inflight = Gauge(
            "kvstack_http_inflight_requests",
            "Requests to the scheduler in flight",
            registry=self.registry,
        )
        self.source_up = Gauge(
            "kvstack_http_metrics_source_up",
            "1 if the service's metrics answered the last scrape",
            ["source"],
            registry=self.registry,
        )

        self.sglang = SGLangMetrics(self.registry, model_name, engine_type)

    def text(self) -> str:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry).decode()


# SGLang's buckets for its tokenizer-side histograms (TokenizerMetricsCollector).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip


class SGLangMetrics:
    """SGLang's tokenizer-side request metrics, under its names, buckets and labels
    (``model_name``, ``engine_type``; ``is_streaming`` where SGLang has it), so that an
    SGLang dashboard reads them: measured here, at the front, as SGLang's tokenizer
    manager measures them."""

    # attribute: SGLang's name, its help, its labels after model_name and engine_type
    COUNTERS: ClassVar[dict[str, tuple[str, str, tuple[str, ...]]]] = {
        "prompt_tokens": (
            "sglang:prompt_tokens",
            "Number of prefill tokens processed.",
            ("is_streaming",),
        ),
        "generation_tokens": (
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            ("is_streaming",),
        ),
        "cached_tokens": (
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            ("cache_source",),
        ),
        "num_requests": ("sglang:num_requests", "Number of requests processed.", ("is_streaming",)),
        "num_aborted": ("sglang:num_aborted_requests", "Number of requests aborted.", ()),
    }
    # attribute: SGLang's name, its help, its labels after the two, its buckets
    HISTOGRAMS: ClassVar[dict[str, tuple[str, str, tuple[str, ...], Sequence[float]]]] = {
        "ttft": (
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ("is_streaming",),
            TTFT_BUCKETS,
        ),
        "itl": (
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            (),
            ITL_BUCKETS,
        ),
        "e2e": (
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            ("is_streaming",),
            E2E_BUCKETS,
        ),
    }

    def __init__(self, registry: Any, model_name: str, engine_type: str) -> None:
        from prometheus_client import Counter, Histogram

        self.labels = {"model_name": model_name, "engine_type": engine_type}
        base = list(self.labels)
        for attr, (name, doc, more) in self.COUNTERS.items():
            setattr(self, attr, Counter(name, doc, [*base, *more], registry=registry))
        for attr, (name, doc, more, buckets) in self.HISTOGRAMS.items():
            histogram = Histogram(name, doc, [*base, *more], buckets=buckets, registry=registry)
            setattr(self, attr, histogram)

    def _streaming(self, stream: bool) -> dict[str, str]:
        return {**self.labels, "is_streaming": "true" if stream else "false"}

    def first_token(self, seconds: float, *, stream: bool) -> None:
        self.ttft.labels(**self._streaming(stream)).observe(seconds)

    def next_tokens(self, seconds: float, num_new_tokens: int) -> None:
        """``num_new_tokens`` came ``seconds`` after the previous ones: each is observed
        at an equal share of the interval, as SGLang does."""
        if num_new_tokens <= 0:
            return
        histogram = self.itl.labels(**self.labels)
        for _ in range(num_new_tokens):
            histogram.observe(seconds / num_new_tokens)

    def finished(self, meta_info: dict[str, Any], seconds: float, *, stream: bool) -> None:
        labels = self._streaming(stream)
        self.prompt_tokens.labels(**labels).inc(int(meta_info.get("prompt_tokens", 0)))
        self.generation_tokens.labels(**labels).inc(int(meta_info.get("completion_tokens", 0)))
        cached = int(meta_info.get("cached_tokens", 0))
        if cached > 0:  # SGLang's source when it has no per-source details
            self.cached_tokens.labels(**self.labels, cache_source="total").inc(cached)
        self.num_requests.labels(**labels).inc()
        self.e2e.labels(**labels).observe(seconds)
        finish = meta_info.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            self.num_aborted.labels(**self.labels).inc()


class Scraper:
    """The services' expositions, read for ``/metrics`` over an HTTP session opened and
    closed with the application."""

    def __init__(self, urls: dict[str, str], metrics: FrontMetrics) -> None:
        self.urls = urls  # service name -> its /metrics URL
        self.metrics = metrics
        self._http: ClientSession | None = None

    async def open(self) -> None:
        self._http = ClientSession(timeout=ClientTimeout(total=SCRAPE_TIMEOUT_S))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def exposition(self) -> bytes:
        """Every service's metrics that answered, and the front's, as one exposition;
        ``kvstack_http_metrics_source_up`` says which answered."""
        names = list(self.urls)
        texts = await asyncio.gather(*(self._scrape(self.urls[n]) for n in names))
        sources = []
        for name, text in zip(names, texts, strict=True):
            found = None
            if text is not None:
                try:
                    found = parse_metrics(text)
                except ValueError as exc:
                    log.warning("metrics of %s are not the text format: %s", name, exc)
            self.metrics.source_up.labels(name).set(0 if found is None else 1)
            if found is not None:
                sources.append((name, found))
        sources.append(("http", parse_metrics(self.metrics.text())))
        return merge_metrics(sources)

    async def _scrape(self, url: str) -> str | None:
        assert self._http is not None
        try:
            async with self._http.get(url) as response:
                if response.status != 200:
                    return None
                return await response.text()
        except (ClientError, OSError, asyncio.TimeoutError) as exc:
            log.debug("scraping %s failed: %s", url, exc)
            return None
