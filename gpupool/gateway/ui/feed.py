"""What the pool page shows, built from the gateway's own state, and the few bounded histories
the page needs that nothing else keeps.

- **Now**: each worker from the registry (state and for how long, window, in-flight and vLLM's
  scraped running/waiting/KV-cache, restarts), each model's queue from ``admission.snapshot()``,
  each GPU from NVML (``workers/gpus.py``; without NVML only the indexes the launch config names,
  memory unknown).
- **Histories**, each a ``deque`` with a fixed bound: warnings and errors logged under
  ``gpupool`` with their request id, worker state changes (a swap group's switches are the
  ``asleep``/``waking`` ones), config reloads, and per-worker completion tokens/s sampled every
  ``SAMPLE_S`` from the ``gpupool_tokens`` counter (the last ``HISTORY_S``), and each model's
  requests the queue refused (429: full, or waited too long) from ``gpupool_admission_decisions``.

:class:`PoolFeed` is attached once per gateway (the app's lifespan) and closed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpupool.gateway.kvroute.predict import status as kv_status
from gpupool.workers.gpus import GpuInfo, discover_gpus
from gpupool.workers.registry import Worker, WorkerState

if TYPE_CHECKING:
    from gpupool.config.models import GpupoolConfig
    from gpupool.gateway.services import Services

log = logging.getLogger("gpupool.ui")

SAMPLE_S = 5.0  # tokens/s and 429s sampled this often
HISTORY_S = 300.0  # tokens/s kept this long (the page's chart)
GPU_EVERY_S = 10.0  # NVML read at most this often (off the loop)
MAX_ERRORS = 50
MAX_CHANGES = 50
MAX_RELOADS = 10
MAX_MESSAGE = 500  # characters of one logged message kept
MAX_WORKER_ROWS = 100  # worker cards in a snapshot; the others are counted by state


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass(slots=True)
class Sampler:
    """Rates from monotonically growing counters, kept for ``HISTORY_S``."""

    last: dict[str, float] = field(default_factory=dict)
    points: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    last_at: float | None = None

    def add(self, totals: dict[str, float], now: float, at_ms: int) -> None:
        if self.last_at is not None and now > self.last_at:
            span = now - self.last_at
            for name, total in totals.items():
                rate = max(0.0, total - self.last.get(name, total)) / span
                keep = int(HISTORY_S / SAMPLE_S) + 1
                self.points.setdefault(name, deque(maxlen=keep)).append((at_ms, round(rate, 2)))
        self.last, self.last_at = dict(totals), now

    def keep(self, names: set[str]) -> None:
        """Forget the series of names gone (workers a reload or discovery removed)."""
        for name in [n for n in self.points if n not in names]:
            del self.points[name]
            self.last.pop(name, None)

    def series(self, name: str) -> list[tuple[int, float]]:
        return list(self.points.get(name, ()))


class ErrorLog(logging.Handler):
    """Keeps the last ``MAX_ERRORS`` warnings and errors logged under ``gpupool``."""

    def __init__(self, request_id: Callable[[], str]) -> None:
        super().__init__(logging.WARNING)
        self.request_id = request_id
        self.entries: deque[dict[str, Any]] = deque(maxlen=MAX_ERRORS)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in someone's log call is not ours to raise
            message = str(record.msg)
        self.entries.append({
            "at": int(record.created * 1000),
            "level": record.levelname.lower(),
            "source": record.name,
            "request_id": self.request_id() or None,
            "message": message[:MAX_MESSAGE],
        })  # fmt: skip


class PoolFeed:
    """One gateway's page feed: :meth:`snapshot` for the event stream; :meth:`close` undoes
    everything :meth:`attach` hooked."""

    def __init__(self, svc: Services, request_id: Callable[[], str]) -> None:
        self.svc = svc
        self.errors = ErrorLog(request_id)
        self.changes: deque[dict[str, Any]] = deque(maxlen=MAX_CHANGES)
        self.reloads: deque[dict[str, Any]] = deque(maxlen=MAX_RELOADS)
        self.tokens = Sampler()
        self.rejected = Sampler()
        self.gpus: list[GpuInfo] | None = None  # None: no NVML answer (yet)
        self.gpus_at = -GPU_EVERY_S
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._logger = logging.getLogger("gpupool")

    @classmethod
    def attach(cls, svc: Services, request_id: Callable[[], str]) -> PoolFeed:
        feed = cls(svc, request_id)
        svc.registry.on_change(feed.on_worker_change)
        svc.reload_hooks.append(feed.on_reload)
        feed._logger.addHandler(feed.errors)
        feed._task = asyncio.get_running_loop().create_task(feed._sample_forever())
        return feed

    async def close(self) -> None:
        self._logger.removeHandler(self.errors)
        with contextlib.suppress(ValueError):
            self.svc.reload_hooks.remove(self.on_reload)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- hooks ------------------------------------------------------------------------------

    def on_worker_change(self, worker: Worker, old: WorkerState) -> None:
        self.changes.append({
            "at": wall_ms(), "worker": worker.name, "model": worker.model,
            "from": old.value, "to": worker.state.value,
        })  # fmt: skip
        self._wake()

    def _wake(self) -> None:
        """Wake every stream waiting on the current event; later ones wait on a new one."""
        self.changed.set()
        self.changed = asyncio.Event()

    def on_reload(self, cfg: GpupoolConfig) -> None:
        entry = {"at": wall_ms(), "workers": len(cfg.workers), "models": len(cfg.models)}
        self.reloads.append(entry)
        self._wake()

    # ---- sampling ---------------------------------------------------------------------------

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.sample()
                await self._refresh_gpus()
            except Exception:  # the page loses a point; the gateway goes on
                log.debug("pool feed: sampling failed", exc_info=True)
            await asyncio.sleep(SAMPLE_S)

    def sample(self) -> None:
        now, at = time.monotonic(), wall_ms()
        m = self.svc.metrics
        completion = _totals(m.tokens.family.collect(), "worker", {"kind": "completion"})
        self.tokens.add(completion, now, at)
        refused = _totals(m.admission.family.collect(), "model", {"decision": "rejected"})
        self.rejected.add(refused, now, at)
        self.tokens.keep({w.name for w in self.svc.registry})
        self.rejected.keep({model.name for model in self.svc.cfg.models})

    async def _refresh_gpus(self) -> None:
        now = time.monotonic()
        if now - self.gpus_at < GPU_EVERY_S:
            return
        self.gpus_at = now
        found = await asyncio.to_thread(discover_gpus)
        self.gpus = found or None

    # ---- what the page gets -----------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        svc = self.svc
        queue = await svc.admission.snapshot()
        workers = list(svc.registry)
        shown, hidden = shown_workers(workers)
        return {
            "at": wall_ms(),
            "auth": svc.cfg.auth.enabled,
            "gpus": gpu_rows(self.gpus, workers),
            "gpus_known": self.gpus is not None,
            "workers": [self.worker_row(w) for w in shown],
            "workers_total": len(workers),
            "workers_hidden": hidden,  # {state: count} of those past MAX_WORKER_ROWS
            "swap_groups": svc.swap.groups_view() if svc.swap is not None else [],
            "queues": self.queue_rows(queue, svc.cfg.models),
            "errors": list(self.errors.entries)[::-1],
            "changes": list(self.changes)[::-1],
            "reloads": list(self.reloads)[::-1],
        }

    def worker_row(self, w: Worker) -> dict[str, Any]:
        return {
            "name": w.name, "model": w.model, "state": w.state.value,
            "state_for_s": round(max(0.0, time.monotonic() - w.state_since), 1),
            "window": w.window, "supervised": w.supervised, "swap_group": w.swap_group,
            "gpus": w.gpus, "inflight": w.inflight, "capacity": w.capacity,
            "running": w.vllm_running, "waiting": w.vllm_waiting, "kv_cache": w.kv_usage,
            "restarts": w.restarts, "last_error": (w.last_error or "")[:MAX_MESSAGE] or None,
            "tokens_per_s": self.tokens.series(w.name),
            "kv_index": kv_status(self.svc.kv, w),  # precise prefix routing (None: off)
        }  # fmt: skip

    def queue_rows(self, snap: dict[str, Any], models: Iterable[Any]) -> list[dict[str, Any]]:
        views = snap.get("models", {})
        rows = []
        for model in models:
            view = views.get(model.name, {})
            last_minute = self.rejected.series(model.name)[-int(60 / SAMPLE_S) :]
            rejected = round(sum(rate for _, rate in last_minute) * SAMPLE_S)
            rows.append({
                "model": model.name, "depth": view.get("depth", 0),
                "oldest_wait_s": view.get("oldest_wait_s", 0.0) if view.get("depth") else 0.0,
                "rejected_last_min": rejected,
            })  # fmt: skip
        return rows


def _totals(families: Iterable[Any], by: str, where: dict[str, str]) -> dict[str, float]:
    """Counter totals summed by one label, for the samples whose labels match ``where``."""
    totals: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            if all(s.labels.get(k) == v for k, v in where.items()):
                key = s.labels.get(by, "")
                totals[key] = totals.get(key, 0.0) + s.value
    return totals


def shown_workers(workers: list[Worker]) -> tuple[list[Worker], dict[str, int]]:
    """The workers the page shows as cards (at most ``MAX_WORKER_ROWS``: those not ready
    first, then in the registry's order) and a count by state of the others, so that a pool
    of thousands (a large DNS answer) costs a snapshot of bounded size every few seconds."""
    if len(workers) <= MAX_WORKER_ROWS:
        return workers, {}
    order = sorted(range(len(workers)), key=lambda i: (workers[i].state is WorkerState.ready, i))
    shown = [workers[i] for i in sorted(order[:MAX_WORKER_ROWS])]
    hidden: dict[str, int] = {}
    for i in order[MAX_WORKER_ROWS:]:
        state = workers[i].state.value
        hidden[state] = hidden.get(state, 0) + 1
    return shown, hidden


def gpu_rows(gpus: list[GpuInfo] | None, workers: list[Worker]) -> list[dict[str, Any]]:
    """Each GPU with its memory (None where NVML cannot say) and the workers launched on it."""
    on: dict[int, list[str]] = {}
    for w in workers:
        for index in w.gpus or ():
            on.setdefault(index, []).append(w.name)
    known = {g.index: g for g in gpus or ()}
    rows = []
    for index in sorted(set(known) | set(on)):
        g = known.get(index)
        rows.append({
            "index": index, "name": g.name if g else None,
            "memory_total_bytes": g.memory_total_bytes if g else None,
            "memory_used_bytes": g.memory_total_bytes - g.memory_free_bytes if g else None,
            "workers": on.get(index, []),
        })  # fmt: skip
    return rows
