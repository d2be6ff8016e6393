"""The one typed object that holds the gateway's services, built from the configuration.

``create_app`` builds it in its lifespan and closes it on shutdown; tests build it the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpupool.config.models import GpupoolConfig, ModelConfig, WorkerConfig
from gpupool.gateway.admission.base import Admission
from gpupool.gateway.admission.factory import build_admission, new_replica_id
from gpupool.gateway.catalog import Catalog
from gpupool.gateway.kvroute.predict import KvRouting
from gpupool.gateway.kvroute.setup import build_kv, kv_source, record_kv
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.pipeline import Pipeline
from gpupool.gateway.routing.policy import Router
from gpupool.gateway.security.limits import KeyLimits
from gpupool.gateway.security.middleware import Authenticator
from gpupool.gateway.security.revoke import KeyRequests
from gpupool.gateway.swap_lease import SwapLeases
from gpupool.gateway.swapping import build_swap, record_asleep
from gpupool.gateway.tenancy.secret import build_scope
from gpupool.gateway.upstream.client import UpstreamClient
from gpupool.gateway.upstream.limits import WorkerLimits
from gpupool.ops.sd_file import sd_file_path, sd_targets, write_sd_targets
from gpupool.workers.discovery import Discovery, DiscoveryHooks
from gpupool.workers.gpus import discover_gpus
from gpupool.workers.registry import MediaCaps, Registry, Worker, WorkerState
from gpupool.workers.remote import RemotePoller
from gpupool.workers.supervisor.command import (
    capacity_of,
    media_limits_of,
    worker_reasoning_parser,
)
from gpupool.workers.supervisor.gpus import detect_cache_keys
from gpupool.workers.supervisor.supervisor import Supervisor
from gpupool.workers.swap.controller import SwapController

log = logging.getLogger("gpupool")
# after a drain's deadline cut its requests, the time they take to give their slots back (a move
# gives the old slot back before it queues for a new one) before the stop goes on regardless
MOVE_GRACE_S = 5.0
_BEGIN_POLLS = 500  # x 10 ms: the longest a deadline waits for its drain to mark the worker


class RegistryView:
    """What admission may know about workers."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def capacity(self, worker: str) -> int:
        w = self.registry.get(worker)
        return w.capacity if w is not None else 0

    def available(self, worker: str) -> bool:
        w = self.registry.get(worker)
        return w is not None and w.routable

    def slots(self, worker: str) -> int:
        w = self.registry.get(worker)
        return w.capacity if w is not None and w.routable else 0


def make_worker(wc: WorkerConfig, model: ModelConfig, default_capacity: int) -> Worker:
    capacity = wc.max_inflight or capacity_of(wc) or default_capacity
    if model.limits is not None:
        media = MediaCaps(model.limits.image, model.limits.video, model.limits.audio)
    elif wc.launch is not None:
        media = media_limits_of(wc)
    else:
        media = MediaCaps()
    return Worker(
        name=wc.name,
        model=wc.model,
        url=wc.url,
        supervised=wc.launch is not None,
        capacity=capacity,
        max_model_len_override=wc.max_model_len,
        media=media,
        gpus=wc.launch.gpus if wc.launch else None,
        reasoning_parser=worker_reasoning_parser(wc, model),
        kv_source=kv_source(wc),
    )


@dataclass
class Services:
    cfg: GpupoolConfig
    registry: Registry
    catalog: Catalog
    metrics: Metrics
    client: UpstreamClient
    admission: Admission
    pipeline: Pipeline
    poller: RemotePoller
    supervisor: Supervisor
    key_limits: KeyLimits
    # who may call (swapped whole by a reload), and the queued requests of each key
    auth: Authenticator = field(kw_only=True)
    key_requests: KeyRequests = field(kw_only=True)
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock, kw_only=True)  # reload.py
    # parts above the services that take a reloaded config's settings (the front door's)
    reload_hooks: list[Callable[[GpupoolConfig], None]] = field(default_factory=list, kw_only=True)
    swap: SwapController | None = field(default=None, kw_only=True)  # swapping.py
    swap_leases: SwapLeases | None = field(default=None, kw_only=True)  # one controller a group
    replica_id: str = field(default_factory=new_replica_id)
    restarts_seen: dict[str, int] = field(default_factory=dict)
    config_path: str | Path | None = None
    discovery: Discovery | None = None  # workers found by DNS (workers[].discover)
    kv: KvRouting | None = None  # precise prefix routing (routing.kv_events)
    _sd_writer: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="gpupool-sd")
    )

    async def start(self) -> None:
        if self.swap_leases is not None:  # before anything starts: another replica may hold
            await self.swap_leases.claim()  # a group: stand by until its claim lapses
        self.write_sd_file()
        await self.admission.start()
        # the salts' generated key, as the other replicas (or the last run) have it
        keys = self.auth.store.keys.values()
        cfg, secret = self.cfg, self.pipeline.salt_secret
        self.pipeline.cache = await build_scope(cfg.tenancy, cfg.auth, keys, secret)
        if self.swap is not None:
            if self.swap_leases is not None:
                self.swap.fence(self.swap_leases.fresh)  # no switch once a claim may lapse
            await self.swap.start()  # its groups read url: workers before the poller marks them
            if self.swap_leases is not None:
                self.swap_leases.start(self.swap.lost_group)
        await self.poller.start()
        await self.supervisor.start()
        if self.discovery is not None:
            await self.discovery.start()

    async def refresh_gauges(self) -> None:
        """Gauges read at scrape time: queue depth, and what workers last reported."""
        snap = await self.admission.snapshot()
        for model in self.cfg.models:
            depth = snap.get("models", {}).get(model.name, {}).get("depth", 0)
            self.metrics.queue_depth.labels(model.name).set(depth)
        for w in self.registry:
            self.metrics.worker_waiting.labels(w.model, w.name).set(w.vllm_waiting)
            self.metrics.worker_kv.labels(w.model, w.name).set(w.kv_usage)
            self.metrics.inflight.labels(w.model, w.name).set(w.inflight)
        if self.kv is not None:
            record_kv(self.kv, self.registry, self.metrics)
        record_asleep(self.registry, self.metrics)

    async def drain(self, worker: Worker, timeout_s: float, cause: str = "drain") -> None:
        """Stop new traffic to ``worker``; its running requests finish, or at ``timeout_s``
        move to another worker (``_at_deadline``). A launched worker's process stays up and
        warm (``Supervisor.drain``: Resume is instant); a ``url:`` worker is ``stopped``."""
        work: Awaitable[object]
        if worker.supervised:
            work = self.supervisor.drain(worker.name, timeout_s + MOVE_GRACE_S)
        else:
            work = self._drain_url(worker, timeout_s + MOVE_GRACE_S)
        await self._by_deadline(worker, timeout_s, cause, work)

    async def stop(self, worker: Worker, timeout_s: float) -> None:
        """As :meth:`drain`, then a launched worker's process ends
        (``Supervisor.stop_worker``): its GPU is free, a Resume is a cold start."""
        work: Awaitable[object]
        if worker.supervised:
            work = self.supervisor.stop_worker(worker.name, timeout_s + MOVE_GRACE_S)
        else:
            work = self._drain_url(worker, timeout_s + MOVE_GRACE_S)
        await self._by_deadline(worker, timeout_s, "stop", work)

    async def _by_deadline(
        self, worker: Worker, timeout_s: float, cause: str, work: Awaitable[object]
    ) -> None:
        deadline = asyncio.create_task(self._at_deadline(worker, timeout_s, cause))
        try:
            await work
        finally:
            deadline.cancel()

    async def _drain_url(self, worker: Worker, timeout_s: float) -> None:
        self.registry.transition(worker, WorkerState.draining)
        await self.registry.wait_idle(worker, timeout_s)
        self.registry.transition(worker, WorkerState.stopped)

    async def restart(self, worker: Worker, timeout_s: float) -> None:
        """Restart a launched worker: drained with a deadline (its requests still running
        then move to another worker), then started again."""
        if worker.state in (WorkerState.ready, WorkerState.draining):
            await self.drain(worker, timeout_s, "restart")
        await self.supervisor.restart(worker.name)

    async def _at_deadline(self, worker: Worker, timeout_s: float, cause: str) -> None:
        """At a drain's, stop's or restart's deadline, the requests still running on
        ``worker`` have their connections cut with ``cause``: they continue on another worker
        where they may (``pipeline/migrate.py``), else end with an error as the stop would end
        them."""
        await asyncio.sleep(timeout_s)
        for _ in range(_BEGIN_POLLS):  # a supervisor's drain that has not begun yet
            if worker.state is not WorkerState.ready:
                break
            await asyncio.sleep(0.01)
        if worker.state is WorkerState.draining and worker.inflight and worker.url:
            log.info("worker %s: %s deadline (%g s) with %d requests running: they move",
                     worker.name, cause, timeout_s, worker.inflight)  # fmt: skip
            self.client.abort(worker.url, cause)

    async def undrain(self, worker: Worker) -> None:
        if worker.supervised:
            await self.supervisor.undrain(worker.name)
            return
        self.registry.transition(worker, WorkerState.starting)
        await self.poller.check(worker)

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        if self.swap is not None:
            await self.swap.close()
        if self.swap_leases is not None:
            await self.swap_leases.close()
        await self.supervisor.stop()
        if self.kv is not None:
            self.kv.close()
            await self.kv.pool.aclose()
        await self.poller.close()
        await self.admission.close()
        await self.key_limits.aclose()
        await self.pipeline.stored.owners.aclose()
        await self.client.close()
        self._sd_writer.shutdown(wait=True)  # the last state reaches disk before we exit

    def on_worker_change(self, worker: Worker, old: WorkerState) -> None:
        self.metrics.worker_state(worker.model, worker.name, worker.state.value)
        self.metrics.capacity.labels(worker.model, worker.name).set(worker.capacity)
        seen = self.restarts_seen.get(worker.name, 0)
        if worker.restarts > seen:
            self.metrics.restarts.labels(worker.model, worker.name).inc(worker.restarts - seen)
            self.restarts_seen[worker.name] = worker.restarts
        log.info("worker %s: %s -> %s", worker.name, old.value, worker.state.value)
        if worker.state is WorkerState.ready:
            self.admission.poke(worker.name)
        elif worker.state is WorkerState.failed and worker.url:
            self._cut_failed(worker, old, worker.url)
        self.write_sd_file()

    def _cut_failed(self, worker: Worker, old: WorkerState, url: str) -> None:
        """A worker that failed has its in-flight requests end now: they move to another
        worker where they may (``pipeline/migrate.py``), else end with an error. Taken out
        while ready: ``worker_out``. A swap group's wake that failed (``wake_failed``) holds
        only the requests its switch paused: they move when another worker of the model is
        ready, or when the worker is launched (its restart ends them anyway); a ``url:``
        member's are kept for its group's next wake otherwise, within their idle deadline
        (``server.upstream_read_timeout_s``, running again from the failure)."""
        if old is WorkerState.ready:
            self.client.abort(url, "worker_out")
        elif old is WorkerState.waking and worker.inflight and self._may_move(worker):
            self.client.abort(url, "wake_failed")

    def _may_move(self, worker: Worker) -> bool:
        """Whether its paused requests are better cut than kept: it is launched (its restart
        ends them), or another worker of its model is ready to take them."""
        return worker.supervised or any(
            w.model == worker.model and w.name != worker.name and w.routable for w in self.registry
        )

    def write_sd_file(self) -> None:
        """Keep Prometheus' file-SD list of worker /metrics targets current (off the loop).

        The entries are snapshotted here, on the loop, and written by one dedicated thread in
        order: two writes on a shared pool could finish out of order and leave an older list
        on disk (a restarted worker missing from Prometheus until the next change).
        """
        path = sd_file_path(self.cfg.server.state_dir)
        targets = sd_targets(self.registry)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            write_sd_targets(path, targets)
            return
        loop.run_in_executor(self._sd_writer, write_sd_targets, path, targets)


def build_services(
    cfg: GpupoolConfig,
    admission: Admission | None = None,
    config_path: str | Path | None = None,
) -> Services:
    registry = Registry()
    for wc in (wc for wc in cfg.workers if wc.discover is None):
        registry.add(make_worker(wc, cfg.model(wc.model), cfg.routing.default_capacity))
    metrics = Metrics()
    kv = build_kv(cfg, registry, metrics)  # before the supervisor: its listener sees every change
    server = cfg.server
    client = UpstreamClient(
        server.upstream_connect_timeout_s,
        server.upstream_read_timeout_s,
        WorkerLimits.of(server),
    )
    replica = new_replica_id()
    admission = admission or build_admission(cfg.queue, RegistryView(registry), replica)
    catalog = Catalog(cfg.models)
    routing = cfg.routing
    router = Router.from_config(routing)
    poller = RemotePoller(registry, client.session, cfg.routing)
    launched = [wc for wc in cfg.workers if wc.launch is not None]
    cache_keys = detect_cache_keys(launched, discover_gpus()) if launched else {}
    supervisor = Supervisor(
        registry, launched, cfg.server, client.session, gpu_cache_keys=cache_keys,
        health_interval_s=cfg.routing.health_interval_s, fail_threshold=cfg.routing.fail_threshold,
        health_timeout_s=cfg.routing.health_timeout_s, models=cfg.models,
        kv_seed=routing.kv_events.hash_seed if routing.kv_events.enabled else None,
    )  # fmt: skip
    key_limits = KeyLimits.from_config(cfg)
    auth = Authenticator(cfg.auth)
    key_requests = KeyRequests(auth.knows)
    pipeline = Pipeline(cfg, registry, catalog, router, admission, client, metrics, key_limits,
                        key_requests=key_requests, kv=kv)  # fmt: skip
    services = Services(
        cfg, registry, catalog, metrics, client, admission, pipeline, poller, supervisor,
        key_limits, replica, config_path=config_path, auth=auth, key_requests=key_requests,
    )  # fmt: skip
    services.kv = kv
    services.swap = build_swap(cfg, registry, client, metrics, supervisor, poller,
                               pipeline.slots)  # fmt: skip
    services.swap_leases = SwapLeases.build(cfg, replica) if services.swap else None
    registry.on_change(services.on_worker_change)
    found = [wc for wc in cfg.workers if wc.discover is not None]
    services.discovery = Discovery(registry, found, discovery_hooks(services)) if found else None
    for w in registry:
        metrics.restarts.labels(w.model, w.name)  # exported as 0 from the start
        metrics.worker_state(w.model, w.name, w.state.value)
        metrics.capacity.labels(w.model, w.name).set(w.capacity)
    return services


def discovery_hooks(svc: Services) -> DiscoveryHooks:
    """Discovered workers join and leave as a reload's url: workers do (reload.py builds a
    Discovery with these when a reload brings the first `discover:` entry)."""

    def make(wc: WorkerConfig) -> Worker:
        return make_worker(wc, svc.cfg.model(wc.model), svc.cfg.routing.default_capacity)

    async def joined(w: Worker) -> None:
        svc.metrics.worker_state(w.model, w.name, w.state.value)
        svc.metrics.capacity.labels(w.model, w.name).set(w.capacity)
        svc.poller.check_soon(w)  # in the background: thousands may join at once

    def removed(w: Worker) -> None:
        svc.metrics.forget_worker(w.model, w.name)
        if svc.kv is not None:
            svc.kv.pool.remove(w.name)
        svc.write_sd_file()

    def failed(entry: str) -> None:
        svc.metrics.discovery_failures.labels(entry).inc()

    def dropped(entry: str, n: int) -> None:
        svc.metrics.discovery_dropped.labels(entry).set(n)

    return DiscoveryHooks(make, joined, svc.drain, removed, failed, dropped)
