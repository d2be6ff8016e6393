"""Wiring of swap groups (``workers/swap``) into the gateway: the controller built from the
configuration, joined to the supervisor's launch gates, the poller's readiness, the pipeline's
waiting requests and the metrics. None when no worker uses sleep mode."""

from __future__ import annotations

import aiohttp

from gpupool.config.models import GpupoolConfig
from gpupool.config.swap import sleeps
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.slots import Slots
from gpupool.workers.registry import Registry
from gpupool.workers.remote import RemotePoller
from gpupool.workers.supervisor.supervisor import Supervisor
from gpupool.workers.swap.controller import SwapController


class SwapMetrics:
    """``SwapEvents`` recorded as the gateway's metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def switched(self, group: str, model: str, seconds: float, waited: int) -> None:
        m = self.metrics
        m.switches.labels(group, model).inc()
        m.switch_seconds.labels(group, model).observe(seconds)
        if waited:
            m.switch_waits.labels(model).inc(waited)


def build_swap(
    cfg: GpupoolConfig,
    registry: Registry,
    session: aiohttp.ClientSession,
    metrics: Metrics,
    supervisor: Supervisor,
    poller: RemotePoller,
    slots: Slots,
) -> SwapController | None:
    if not any(sleeps(w) for w in cfg.workers):
        return None
    swap = SwapController(
        registry, session, cfg.workers, cfg.swap, SwapMetrics(metrics), supervisor.restart,
        probe_timeout_s=cfg.routing.health_timeout_s, read_s=cfg.routing.health_interval_s,
    )  # fmt: skip
    supervisor.use_launch_gates(swap.gate)
    poller.may_ready = swap.may_ready
    slots.demand = swap.demand
    return swap


def record_asleep(registry: Registry, metrics: Metrics) -> None:
    """The time-asleep gauge, refreshed at scrape time."""
    for w in registry:
        if w.swap_group is not None:
            metrics.asleep_seconds.labels(w.model, w.name).set(round(w.time_asleep_s(), 3))
