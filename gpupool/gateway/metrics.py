"""Every metric the gateway exposes, declared in one place. Callers use the methods below.

All series carry ``model`` and, where a worker is involved, ``worker``. Buckets follow vLLM's
so gateway and worker histograms line up on one dashboard.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class _Tally:
    """A float without a lock, in place of ``prometheus_client``'s ``MutexValue``.

    Every hot series is written on the event loop's thread only; a scrape reads a float, which
    the GIL keeps whole. The lock cost more than the addition it guarded.
    """

    __slots__ = ("_exemplar", "_value")

    def __init__(self, value: float) -> None:
        self._value = value
        self._exemplar: object = None

    def inc(self, amount: float = 1.0) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: object) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> object:
        return self._exemplar


class HotCounter:
    """A labelled counter touched on every request: ``labels(...).inc(n)``, nothing more.

    ``prometheus_client``'s ``labels()`` validates and locks on every call, and its ``inc()``
    checks and locks again; the label sets of a pool are few and change only when a worker
    leaves (``forget``), so the child's value is kept here behind a dict lookup and added to
    directly.
    """

    __slots__ = ("_children", "family")

    def __init__(self, family: Counter) -> None:
        self.family = family
        self._children: dict[tuple[str, ...], _Tally] = {}

    def labels(self, *values: str) -> _Tally:
        tally = self._children.get(values)
        if tally is None:
            tally = self._children[values] = _unlocked(self.family.labels(*values), "_value")
        return tally

    def forget(self, *prefix: str) -> None:
        """Drop every child whose first labels are ``prefix`` (a worker that left)."""
        _forget(self._children, self.family, prefix)


class _HotChild:
    """One histogram child's buckets and sum, observed without locks or per-call checks."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._sum = _unlocked(child, "_sum")
        self._bounds: list[float] = child._upper_bounds
        self._buckets: list[_Tally] = [_Tally(b.get()) for b in child._buckets]
        child._buckets = self._buckets

    def observe(self, amount: float) -> None:
        self._sum._value += amount
        self._buckets[bisect_left(self._bounds, amount)]._value += 1


class HotHistogram:
    """A labelled histogram touched on every request: ``labels(...).observe(x)``."""

    __slots__ = ("_children", "family")

    def __init__(self, family: Histogram) -> None:
        self.family = family
        self._children: dict[tuple[str, ...], _HotChild] = {}

    def labels(self, *values: str) -> _HotChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _HotChild(self.family.labels(*values))
        return child

    def forget(self, *prefix: str) -> None:
        """Drop every child whose first labels are ``prefix`` (a worker that left)."""
        _forget(self._children, self.family, prefix)


def _forget(children: dict[tuple[str, ...], Any], family: Counter | Histogram,
            prefix: tuple[str, ...]) -> None:  # fmt: skip
    for values in [v for v in children if v[: len(prefix)] == prefix]:
        del children[values]
        with contextlib.suppress(KeyError):
            family.remove(*values)


def _remove_labelled(family: Counter | Gauge, labels: dict[str, str]) -> None:
    """Remove every child of a plain ``family`` whose labels include ``labels``: its label
    sets read from what it exports (``collect``), as ``prometheus_client`` lists them nowhere
    else publicly."""
    names: tuple[str, ...] = family._labelnames
    seen = set()
    for metric in family.collect():
        for sample in metric.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                seen.add(tuple(sample.labels[n] for n in names))
    for values in seen:
        with contextlib.suppress(KeyError):
            family.remove(*values)


class Served:
    """One (model, worker)'s per-request series, looked up once: what a request records when
    it ends (``Metrics.served``). Token series appear with their first tokens, as before."""

    __slots__ = ("_completion", "_key", "_m", "_prompt", "_statuses", "latency")

    def __init__(self, metrics: Metrics, model: str, worker: str) -> None:
        self._m = metrics
        self._key = (model, worker)
        self.latency = metrics.latency.labels(model, worker)
        self._statuses: dict[str, _Tally] = {}
        self._prompt: _Tally | None = None
        self._completion: _Tally | None = None

    def record(self, status: str, seconds: float, prompt: int, completion: int) -> None:
        tally = self._statuses.get(status)
        if tally is None:
            tally = self._statuses[status] = self._m.requests.labels(*self._key, status)
        tally._value += 1
        self.latency.observe(seconds)
        if prompt:
            if self._prompt is None:
                self._prompt = self._m.tokens.labels(*self._key, "prompt")
            self._prompt._value += prompt
        if completion:
            if self._completion is None:
                self._completion = self._m.tokens.labels(*self._key, "completion")
            self._completion._value += completion


class Admitted:
    """One model's admission series for a granted slot (``Metrics.admitted``)."""

    __slots__ = ("immediate", "queued", "wait")

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.immediate = metrics.admission.labels(model, "immediate", "")
        self.queued = metrics.admission.labels(model, "queued", "")
        self.wait = metrics.queue_wait.labels(model)

    def record(self, queued_s: float) -> None:
        if queued_s > 0:
            self.queued._value += 1
            self.wait.observe(queued_s)
        else:  # ``wait.observe(0.0)`` without the search: the first bucket, the sum unchanged
            self.immediate._value += 1
            self.wait._buckets[0]._value += 1


def _unlocked(child: Counter | Histogram, attr: str) -> _Tally:
    """Swap the child's locked value ``attr`` for a :class:`_Tally` (same reads for a scrape).

    Fails loudly (AttributeError) if ``prometheus_client`` renames it: see
    tests/gateway/test_metrics_hot.py."""
    tally = _Tally(getattr(child, attr).get())
    setattr(child, attr, tally)
    return tally


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

WORKER_STATES = ("starting", "warming", "ready", "draining", "stopped", "failed",
                 "falling_asleep", "asleep", "waking")  # fmt: skip
KV_ERROR_BUCKETS = (0.0, 16.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0)
SWITCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        mw = ["model", "worker"]
        self.requests = HotCounter(Counter(
            "gpupool_requests", "Requests answered, by status.", [*mw, "status"], registry=r,
        ))  # fmt: skip
        self.errors = Counter("gpupool_errors", "Errors by cause.", [*mw, "cause"], registry=r)
        self.latency = HotHistogram(Histogram(
            "gpupool_request_duration_seconds", "End-to-end request time at the gateway.",
            mw, buckets=LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.ttft = HotHistogram(Histogram(
            "gpupool_time_to_first_token_seconds", "Time to the first streamed byte.",
            mw, buckets=TTFT_BUCKETS, registry=r,
        ))  # fmt: skip
        self.itl = HotHistogram(Histogram(
            "gpupool_inter_chunk_seconds", "Gap between streamed chunks.",
            mw, buckets=ITL_BUCKETS, registry=r,
        ))  # fmt: skip
        self.tokens = HotCounter(Counter(
            "gpupool_tokens", "Tokens from usage, by kind (prompt|completion).",
            [*mw, "kind"], registry=r,
        ))  # fmt: skip
        self.inflight = Gauge("gpupool_inflight", "Requests in flight.", mw, registry=r)
        self.capacity = Gauge("gpupool_worker_capacity", "Worker capacity.", mw, registry=r)
        self.up = Gauge("gpupool_worker_up", "1 when the worker is ready.", mw, registry=r)
        self.state = Gauge(
            "gpupool_worker_state", "1 for the worker's current state.", [*mw, "state"],
            registry=r,
        )  # fmt: skip
        self.restarts = Counter("gpupool_worker_restarts", "Worker restarts.", mw, registry=r)
        self.worker_waiting = Gauge(
            "gpupool_worker_vllm_waiting", "vLLM's waiting requests (scraped).", mw, registry=r
        )
        self.worker_kv = Gauge(
            "gpupool_worker_vllm_kv_cache_usage", "vLLM's KV-cache usage 0..1 (scraped).",
            mw, registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("gpupool_queue_depth", "Requests waiting.", ["model"], registry=r)
        self.discovery_failures = Counter(
            "gpupool_discovery_failures",
            "Failed DNS lookups of a `discover:` entry (its last good set of workers was kept).",
            ["entry"], registry=r,
        )  # fmt: skip
        self.discovery_dropped = Gauge(
            "gpupool_discovery_dropped",
            "Addresses of a `discover:` entry's last answer left out: beyond its `max_workers` "
            "or the descriptors the gateway keeps for itself.",
            ["entry"], registry=r,
        )  # fmt: skip
        self.queue_wait = HotHistogram(Histogram(
            "gpupool_queue_wait_seconds", "Time spent waiting for a slot.", ["model"],
            buckets=WAIT_BUCKETS, registry=r,
        ))  # fmt: skip
        self.admission = HotCounter(Counter(
            "gpupool_admission_decisions", "Admission outcomes (immediate|queued|rejected).",
            ["model", "decision", "reason"], registry=r,
        ))  # fmt: skip
        self.retries = Counter(
            "gpupool_upstream_retries", "Requests retried on another worker before any byte.",
            [*mw, "reason"], registry=r,
        )  # fmt: skip
        # request migration (pipeline/migrate.py): an answer moved after it began
        self.migrations = Counter(
            "gpupool_migrations", "Requests moved to another worker after their answer began, "
            "by cause (worker_died; worker_out: taken out by its checks; timeout; drain; restart; "
            "wake_failed: a swap group's wake of the worker that held them paused failed) "
            "and "
            "outcome (continued: a stream went on from its text; restarted: sent again, "
            "nothing had reached the client; ended: "
            "every token had gone out, the gateway ended the stream; refused: it cannot be "
            "continued exactly; failed: no worker took it, or migrations are exhausted).",
            ["model", "cause", "outcome"], registry=r,
        )  # fmt: skip
        self.reprefilled = Counter(
            "gpupool_migration_reprefilled_tokens", "Tokens of answers fed back to a new "
            "worker as prompt by migrations (estimated: one a text event).", ["model"],
            registry=r,
        )  # fmt: skip
        # sleep mode (gpupool/workers/swap): models taking turns on a GPU
        self.switches = Counter(
            "gpupool_swap_switches", "Switches of a swap group's GPU to a model (by the model "
            "woken).", ["group", "model"], registry=r,
        )  # fmt: skip
        self.switch_seconds = Histogram(
            "gpupool_swap_switch_seconds", "From the decision to switch to the woken worker "
            "ready: the running requests' drain, the sleep and the wake.", ["group", "model"],
            buckets=SWITCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.switch_waits = Counter(
            "gpupool_swap_waited_requests", "Requests that waited in the queue for their model "
            "to be woken.", ["model"], registry=r,
        )  # fmt: skip
        self.swap_paused = Counter(
            "gpupool_swap_paused_requests", "Running requests a switch paused (vLLM's "
            "`/sleep?mode=keep`, after `swap.pause_after_s`) until their model's next wake.",
            ["group", "model"], registry=r,
        )  # fmt: skip
        self.asleep_seconds = Gauge(
            "gpupool_worker_asleep_seconds", "Seconds the worker has spent asleep in all.",
            mw, registry=r,
        )  # fmt: skip
        # precise prefix routing (gateway/kvroute, workers/kvevents): touched on every request
        self.kv_routed = HotCounter(Counter(
            "gpupool_kv_routed_requests", "Requests by how prefix routing knew the caches: "
            "precise (KV events), or approximate and why.", ["model", "mode"], registry=r,
        ))  # fmt: skip
        self.kv_predictions = HotCounter(Counter(
            "gpupool_kv_predictions", "Precisely routed requests by how the predicted cached "
            "tokens compared with vLLM's reported cached_tokens (exact|over|under).",
            [*mw, "outcome"], registry=r,
        ))  # fmt: skip
        self.kv_prediction_error = HotHistogram(Histogram(
            "gpupool_kv_prediction_error_tokens", "|predicted - reported| cached tokens.",
            ["model"], buckets=KV_ERROR_BUCKETS, registry=r,
        ))  # fmt: skip
        self.kv_blocks = Gauge(
            "gpupool_kv_indexed_blocks", "Blocks the worker's index holds (from its KV events).",
            mw, registry=r,
        )  # fmt: skip
        self.kv_events = Gauge(
            "gpupool_kv_event_batches", "KV-event batches applied since start (a counter; "
            "rate() gives events per second).", mw, registry=r,
        )  # fmt: skip
        self.kv_gaps = Gauge("gpupool_kv_event_gaps", "Sequence gaps seen since start.", mw,
                             registry=r)  # fmt: skip
        self.kv_resyncs = Gauge(
            "gpupool_kv_event_resyncs", "Gaps the replay could not fill (index dropped) since "
            "start.", mw, registry=r,
        )  # fmt: skip
        self.kv_precise = Gauge(
            "gpupool_kv_worker_precise", "1 while the worker is routed on its KV events.", mw,
            registry=r,
        )  # fmt: skip

        self._served: dict[tuple[str, str], Served] = {}
        self._admitted: dict[str, Admitted] = {}

    def served(self, model: str, worker: str) -> Served:
        """The series a request on ``worker`` records when it ends."""
        bundle = self._served.get((model, worker))
        if bundle is None:
            bundle = self._served[(model, worker)] = Served(self, model, worker)
        return bundle

    def admitted(self, model: str) -> Admitted:
        """The series a granted slot of ``model`` records."""
        bundle = self._admitted.get(model)
        if bundle is None:
            bundle = self._admitted[model] = Admitted(self, model)
        return bundle

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def worker_state(self, model: str, worker: str, state: str) -> None:
        for s in WORKER_STATES:
            self.state.labels(model, worker, s).set(1.0 if s == state else 0.0)
        self.up.labels(model, worker).set(1.0 if state == "ready" else 0.0)

    def forget_worker(self, model: str, worker: str) -> None:
        for g in (self.up, self.capacity, self.inflight, self.worker_waiting, self.worker_kv,
                  self.kv_blocks, self.kv_events, self.kv_gaps, self.kv_resyncs,
                  self.kv_precise):  # fmt: skip
            with contextlib.suppress(KeyError):
                g.remove(model, worker)
        for s in WORKER_STATES:
            with contextlib.suppress(KeyError):
                self.state.remove(model, worker, s)
        # the per-request series too: a pool whose workers come and go (DNS discovery, reloads)
        # would otherwise keep every worker it ever had, in memory and in every scrape
        with contextlib.suppress(KeyError):
            self.restarts.remove(model, worker)
        with contextlib.suppress(KeyError):
            self.asleep_seconds.remove(model, worker)
        self._served.pop((model, worker), None)
        for hot in (self.requests, self.tokens, self.latency, self.ttft, self.itl,
                    self.kv_predictions):  # fmt: skip
            hot.forget(model, worker)
        for family in (self.errors, self.retries):
            _remove_labelled(family, {"model": model, "worker": worker})
