"""vLLM's Prometheus metrics (names, labels, buckets of ``v1/metrics/loggers.py``), per app.

The hot path only bumps plain numbers (a ``prometheus_client`` observe costs microseconds and
takes a lock); a collector turns them into metric families when ``/metrics`` is scraped. The
output matches vLLM's default-registry text: ``_total`` counters with ``_created`` series,
labels ``engine`` and ``model_name`` in sorted order.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"  # whatever the Accept header says
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_LABELS = ("engine", "model_name")

_GAUGE_DOCS = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
_COUNTER_DOCS = {
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemption.",
}
_HISTOGRAM_DOCS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
}


class Hist:
    """A cheap histogram: per-bucket counts (``le`` semantics) and a sum."""

    __slots__ = ("bounds", "counts", "created", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, None), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound is None else repr(bound), float(running)))
        return out


class SimMetrics:
    """Numbers the engine bumps; gauges read the engine's live state at scrape time."""

    def __init__(
        self,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.labels = ["0", model_name]
        self.gauges = {
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_cache_usage_perc": kv_usage,
        }
        self.counters = dict.fromkeys(_COUNTER_DOCS, 0.0)
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Hist(TTFT_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)
        self.e2e = Hist(LATENCY_BUCKETS)
        self.queue_time = Hist(LATENCY_BUCKETS)
        self.created = time.time()
        self.cache_info: dict[str, str] | None = None  # vllm:cache_config_info's labels
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        if self.cache_info is not None:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                     "CacheConfig", labels=list(self.cache_info))  # fmt: skip
            info.add_metric(list(self.cache_info.values()), 1.0)
            yield info
        yield from self._gauges()
        yield from self._counters()
        yield self._success()
        hists = (self.ttft, self.itl, self.e2e, self.queue_time)
        for (name, doc), hist in zip(_HISTOGRAM_DOCS.items(), hists, strict=True):
            yield self._histogram(name, doc, hist)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _gauges(self) -> Iterator[Metric]:
        for name, fn in self.gauges.items():
            fam = GaugeMetricFamily("vllm:" + name, _GAUGE_DOCS[name], labels=_LABELS)
            fam.add_metric(self.labels, fn())
            yield fam

    def _counters(self) -> Iterator[Metric]:
        for name, value in self.counters.items():
            fam = CounterMetricFamily("vllm:" + name, _COUNTER_DOCS[name], labels=_LABELS)
            fam.add_metric(self.labels, value, created=self.created)
            yield fam

    def _success(self) -> Metric:
        fam = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=("engine", "finished_reason", "model_name"),
        )
        for reason, count in self.success.items():
            fam.add_metric([self.labels[0], reason, self.labels[1]], count, created=self.created)
        return fam

    def _histogram(self, name: str, doc: str, hist: Hist) -> Metric:
        fam = HistogramMetricFamily("vllm:" + name, doc, labels=_LABELS)
        fam.add_metric(self.labels, hist.cumulative(), hist.total)
        labels = dict(zip(_LABELS, self.labels, strict=True))
        fam.samples.append(Sample(fam.name + "_created", labels, hist.created, None))
        return fam
