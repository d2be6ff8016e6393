"""The per-request metrics (``HotCounter``/``HotHistogram``) as a scrape shows them.

They write into ``prometheus_client``'s children without its locks; these tests read the
exposition a Prometheus server would scrape, and fail loudly if ``prometheus_client`` changes the
internals that the lock-free values replace.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from gpupool.gateway.metrics import Metrics


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_add_up_in_the_scrape() -> None:
    m = Metrics()
    m.requests.labels("chat", "w1", "200").inc()
    m.requests.labels("chat", "w1", "200").inc()
    m.requests.labels("chat", "w1", "429").inc()
    m.tokens.labels("chat", "w1", "completion").inc(64)
    got = _samples(m)
    ok = (("model", "chat"), ("status", "200"), ("worker", "w1"))
    assert got[("gpupool_requests_total", ok)] == 2.0
    assert got[("gpupool_requests_total", (*ok[:1], ("status", "429"), ok[2]))] == 1.0
    kind = (("kind", "completion"), ("model", "chat"), ("worker", "w1"))
    assert got[("gpupool_tokens_total", kind)] == 64.0


def test_histograms_fill_the_right_buckets() -> None:
    m = Metrics()
    h = m.latency.labels("chat", "w1")
    for seconds in (0.004, 0.05, 0.3, 3.0, 9000.0):
        h.observe(seconds)
    got = _samples(m)
    labels = (("model", "chat"), ("worker", "w1"))

    def bucket(le: str) -> float:
        return got[("gpupool_request_duration_seconds_bucket", (("le", le), *labels))]

    # le is inclusive: 0.05 lands in the 0.05 bucket, as prometheus_client's own observe() does
    edges = ("0.01", "0.05", "0.1", "0.3", "2.5", "5.0", "7680.0", "+Inf")
    assert [bucket(le) for le in edges] == [1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0]
    assert got[("gpupool_request_duration_seconds_count", labels)] == 5.0
    assert abs(got[("gpupool_request_duration_seconds_sum", labels)] - 9003.354) < 1e-9


def test_the_lock_free_values_are_the_ones_scraped() -> None:
    """Guards the shortcut: the child prometheus_client exposes holds our value objects."""
    m = Metrics()
    tally = m.admission.labels("chat", "immediate", "")
    child = m.admission.family.labels("chat", "immediate", "")
    assert isinstance(child, Counter) and child._value is tally
    hist = m.queue_wait.labels("chat")
    hchild = m.queue_wait.family.labels("chat")
    assert isinstance(hchild, Histogram) and hchild._sum is hist._sum
    assert hchild._buckets is hist._buckets


def test_bundles_scrape_as_the_labelled_calls_they_replace() -> None:
    """``Metrics.served``/``admitted`` (one lookup a request) against the same figures written
    through ``labels()``: the scrape must not tell them apart."""
    bundled, plain = Metrics(), Metrics()
    for status, seconds, prompt, completion in (("200", 0.2, 10, 5), ("200", 3.0, 7, 0),
                                                ("502", 0.01, 0, 0)):  # fmt: skip
        bundled.served("chat", "w1").record(status, seconds, prompt, completion)
        plain.requests.labels("chat", "w1", status).inc()
        plain.latency.labels("chat", "w1").observe(seconds)
        for kind, n in (("prompt", prompt), ("completion", completion)):
            if n:
                plain.tokens.labels("chat", "w1", kind).inc(n)
    for queued_s in (0.0, 0.0, 0.3, 12.0):
        bundled.admitted("chat").record(queued_s)
        plain.admission.labels("chat", "queued" if queued_s > 0 else "immediate", "").inc()
        plain.queue_wait.labels("chat").observe(queued_s)

    def figures(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {k: v for k, v in _samples(m).items() if not k[0].endswith("_created")}

    assert figures(bundled) == figures(plain)
    # a series appears with its first value, as through labels(): no 0-valued token series
    fresh = Metrics()
    fresh.served("chat", "w2").record("200", 0.1, 0, 0)
    assert not any(name == "gpupool_tokens_total" for name, _ in _samples(fresh))


def test_a_worker_that_leaves_takes_every_series_it_had() -> None:
    """A pool whose workers come and go (DNS discovery, reloads) keeps no series of a worker
    it no longer has, in memory or in the scrape; one that comes back starts from zero."""
    m = Metrics()
    for worker in ("w1", "w2"):
        m.served("chat", worker).record("200", 0.2, 10, 5)
        m.ttft.labels("chat", worker).observe(0.1)
        m.itl.labels("chat", worker).observe(0.01)
        m.errors.labels("chat", worker, "upstream").inc()
        m.retries.labels("chat", worker, "status").inc()
        m.restarts.labels("chat", worker).inc()
        m.asleep_seconds.labels("chat", worker).set(3)
        m.worker_state("chat", worker, "ready")
        m.kv_predictions.labels("chat", worker, "exact").inc()
    m.forget_worker("chat", "w1")
    left = {dict(labels).get("worker") for _, labels in _samples(m)}
    assert "w1" not in left and "w2" in left
    kept = (("model", "chat"), ("status", "200"), ("worker", "w2"))
    assert _samples(m)[("gpupool_requests_total", kept)] == 1.0
    m.served("chat", "w1").record("200", 0.2, 10, 5)  # back under the same name
    back = (("model", "chat"), ("status", "200"), ("worker", "w1"))
    assert _samples(m)[("gpupool_requests_total", back)] == 1.0
    tokens = (("kind", "prompt"), ("model", "chat"), ("worker", "w1"))
    assert _samples(m)[("gpupool_tokens_total", tokens)] == 10.0
