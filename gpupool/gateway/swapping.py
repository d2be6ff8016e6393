"""Wiring of swap groups (``workers/swap``) into the gateway: the controller built from the
configuration, joined to the supervisor's launch gates, the poller's readiness, the pipeline's
waiting requests, the upstream pool's idle deadlines (held while a worker's requests are paused)
and the metrics. None when no worker uses sleep mode."""

from __future__ import annotations

from collections.abc import Callable

from gpupool.config.models import GpupoolConfig, WorkerConfig
from gpupool.config.swap import sleeps
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.slots import Slots
from gpupool.gateway.upstream.client import UpstreamClient
from gpupool.gateway.upstream.http1 import origin_of
from gpupool.workers.gpus import NvmlProcessMemory
from gpupool.workers.registry import Registry
from gpupool.workers.remote import RemotePoller
from gpupool.workers.sim.memory import LedgerMemory
from gpupool.workers.supervisor.supervisor import Supervisor
from gpupool.workers.swap.controller import SwapController
from gpupool.workers.swap.memory import GpuMemory


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

    def paused(self, group: str, model: str, requests: int) -> None:
        self.metrics.swap_paused.labels(group, model).inc(requests)


def build_swap(
    cfg: GpupoolConfig,
    registry: Registry,
    client: UpstreamClient,
    metrics: Metrics,
    supervisor: Supervisor,
    poller: RemotePoller,
    slots: Slots,
) -> SwapController | None:
    if not any(sleeps(w) for w in cfg.workers):
        return None
    swap = SwapController(
        registry, client.session, cfg.workers, cfg.swap, SwapMetrics(metrics), supervisor.restart,
        probe_timeout_s=cfg.routing.health_timeout_s, read_s=cfg.routing.health_interval_s,
        memory=memory_of,
    )  # fmt: skip
    supervisor.use_launch_gates(swap.gate)
    poller.may_ready = swap.may_ready
    slots.demand = swap.demand
    slots.swap = swap
    client.hold_by(held_since(registry))
    return swap


def memory_of(wc: WorkerConfig) -> GpuMemory | None:
    """Where a launched worker's GPU memory is read: NVML, or, for a simulator with a sleep
    ledger (``gpupool sim --sleep-ledger``), that ledger, the simulated GPU's NVML."""
    if wc.launch is None:
        return None
    for key, value in wc.launch.args.items():
        if key.lstrip("-").replace("_", "-") == "sleep-ledger":
            return LedgerMemory(str(value))
    return NvmlProcessMemory()


def held_since(registry: Registry) -> Callable[[str], float]:
    """An origin's last pause of its requests, for the upstream pool's idle deadlines: the
    latest of its swap-group workers' (infinity while one holds requests paused)."""

    def held(origin: str) -> float:
        return max(
            (w.held_since() for w in registry
             if w.swap_group is not None and w.url is not None and origin_of(w.url) == origin),
            default=0.0,
        )  # fmt: skip

    return held


def record_asleep(registry: Registry, metrics: Metrics) -> None:
    """The time-asleep gauge, refreshed at scrape time."""
    for w in registry:
        if w.swap_group is not None:
            metrics.asleep_seconds.labels(w.model, w.name).set(round(w.time_asleep_s(), 3))
