"""Every metric the gateway exposes, declared in one place. Callers use the methods below.

All series carry ``model`` and, where a worker is involved, ``worker``. Buckets follow vLLM's
so gateway and worker histograms line up on one dashboard.
"""

from __future__ import annotations

import contextlib
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

M = TypeVar("M", Counter, Histogram)


class Hot(Generic[M]):
    """A counter or histogram touched on every request: its labelled children are kept.

    ``prometheus_client``'s ``labels()`` validates and locks on every call; the label sets of a
    pool are few and fixed, and these families never drop a child, so a dict lookup does.
    """

    __slots__ = ("_children", "family")

    def __init__(self, family: M) -> None:
        self.family: M = family
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.family.labels(*values)
        return child


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

WORKER_STATES = ("starting", "warming", "ready", "draining", "stopped", "failed")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        mw = ["model", "worker"]
        self.requests = Hot(Counter(
            "gpupool_requests", "Requests answered, by status.", [*mw, "status"], registry=r,
        ))  # fmt: skip
        self.errors = Counter("gpupool_errors", "Errors by cause.", [*mw, "cause"], registry=r)
        self.latency = Hot(Histogram(
            "gpupool_request_duration_seconds", "End-to-end request time at the gateway.",
            mw, buckets=LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.ttft = Hot(Histogram(
            "gpupool_time_to_first_token_seconds", "Time to the first streamed byte.",
            mw, buckets=TTFT_BUCKETS, registry=r,
        ))  # fmt: skip
        self.itl = Hot(Histogram(
            "gpupool_inter_chunk_seconds", "Gap between streamed chunks.",
            mw, buckets=ITL_BUCKETS, registry=r,
        ))  # fmt: skip
        self.tokens = Hot(Counter(
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
        self.queue_wait = Hot(Histogram(
            "gpupool_queue_wait_seconds", "Time spent waiting for a slot.", ["model"],
            buckets=WAIT_BUCKETS, registry=r,
        ))  # fmt: skip
        self.admission = Hot(Counter(
            "gpupool_admission_decisions", "Admission outcomes (immediate|queued|rejected).",
            ["model", "decision", "reason"], registry=r,
        ))  # fmt: skip
        self.retries = Counter(
            "gpupool_upstream_retries", "Requests retried on another worker before any byte.",
            [*mw, "reason"], registry=r,
        )  # fmt: skip

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def worker_state(self, model: str, worker: str, state: str) -> None:
        for s in WORKER_STATES:
            self.state.labels(model, worker, s).set(1.0 if s == state else 0.0)
        self.up.labels(model, worker).set(1.0 if state == "ready" else 0.0)

    def forget_worker(self, model: str, worker: str) -> None:
        for g in (self.up, self.capacity, self.inflight, self.worker_waiting, self.worker_kv):
            with contextlib.suppress(KeyError):
                g.remove(model, worker)
        for s in WORKER_STATES:
            with contextlib.suppress(KeyError):
                self.state.remove(model, worker, s)
