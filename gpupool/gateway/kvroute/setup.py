"""Building precise prefix routing from the configuration, and its gauges at scrape time."""

from __future__ import annotations

from urllib.parse import urlsplit

from gpupool.config.models import GpupoolConfig, WorkerConfig
from gpupool.gateway.kvroute.predict import KvRouting
from gpupool.gateway.metrics import Metrics
from gpupool.workers.kvevents.source import KvSource
from gpupool.workers.registry import Registry


def kv_source(wc: WorkerConfig) -> KvSource | None:
    """A ``url:`` worker's configured event source; ``{host}`` in an endpoint is the host of
    the worker's URL (the port convention of workers found by DNS: every address publishes on
    the same ports)."""
    kv = wc.kv_events
    if kv is None:
        return None
    host = urlsplit(wc.url).hostname or "" if wc.url else ""
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address, as ZMQ writes it

    def fill(endpoint: str | None) -> str | None:
        return endpoint.replace("{host}", host) if endpoint else endpoint

    endpoint = fill(kv.endpoint)
    assert endpoint is not None
    return KvSource(endpoint, fill(kv.replay_endpoint), kv.topic, kv.hash_seed)


def build_kv(cfg: GpupoolConfig, registry: Registry, metrics: Metrics) -> KvRouting | None:
    """None unless ``routing.kv_events.enabled`` or a worker names its events."""
    kc = cfg.routing.kv_events
    if not kc.enabled and not any(wc.kv_events is not None for wc in cfg.workers):
        return None
    from gpupool.workers.kvevents.pool import KvPool  # ZeroMQ: loaded only where it is on

    pool = KvPool(kc.max_blocks_per_worker, kc.pending_s)
    registry.on_change(pool.on_change)
    for w in registry:
        if w.kv_source is not None:
            pool.watch(w)
    return KvRouting.from_config(cfg, pool, metrics)


def record_kv(kv: KvRouting, registry: Registry, metrics: Metrics) -> None:
    """Per worker: blocks indexed, batches applied, gaps, resyncs, and whether it is precise."""
    for w in registry:
        index = kv.pool.index(w.name)
        labels = (w.model, w.name)
        metrics.kv_precise.labels(*labels).set(0 if kv.why_not(w) else 1)
        if index is None:
            continue
        st = index.stats
        metrics.kv_blocks.labels(*labels).set(len(index))
        metrics.kv_events.labels(*labels).set(st.batches)
        metrics.kv_gaps.labels(*labels).set(st.gaps)
        metrics.kv_resyncs.labels(*labels).set(st.resyncs)
