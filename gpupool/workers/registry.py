"""The worker registry: the one owner of worker state.

Routing reads it; the remote poller and the supervisor write it; admin endpoints show it.
Per-request counters (in flight, requests, consecutive failures) change only through the
registry's methods (``started``, ``finished``, ``succeeded``, ``failed``); a drain waits on
:meth:`Registry.wait_idle`, woken when the last request ends. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from gpupool.workers.kvevents.source import KvSource
from gpupool.workers.probe import CacheInfo


class WorkerState(StrEnum):
    starting = "starting"
    warming = "warming"
    ready = "ready"
    draining = "draining"
    stopped = "stopped"
    failed = "failed"
    # sleep mode (gpupool/workers/swap): running requests finish, then vLLM's /sleep
    falling_asleep = "falling_asleep"
    asleep = "asleep"
    waking = "waking"


# States in which a worker of a swap group holds no GPU memory of its own beyond vLLM's
# (asleep) or is on its way in or out of it; routing queues for them, never sends to them.
SLEEP_STATES = frozenset({WorkerState.falling_asleep, WorkerState.asleep, WorkerState.waking})


@dataclass(slots=True)
class MediaCaps:
    """Media items per prompt a worker admits; None means unlimited."""

    image: int | None = None
    video: int | None = None
    audio: int | None = None

    def admits(self, image: int, video: int, audio: int) -> bool:
        return all(
            limit is None or n <= limit
            for n, limit in ((image, self.image), (video, self.video), (audio, self.audio))
        )


@dataclass(slots=True)
class Worker:
    name: str
    model: str
    url: str | None = None
    state: WorkerState = WorkerState.starting
    supervised: bool = False
    max_model_len: int | None = None
    max_model_len_override: int | None = None
    capacity: int = 64
    media: MediaCaps = field(default_factory=MediaCaps)
    reasoning_parser: str | None = None  # vLLM's own --reasoning-parser: never split again
    inflight: int = 0
    requests_total: int = 0
    # scraped from the worker's own /metrics
    vllm_waiting: float = 0.0
    vllm_running: float = 0.0
    kv_usage: float = 0.0
    # what vLLM ran or queued beyond this gateway's own requests when last scraped (see scraped)
    vllm_external: float = 0.0
    vllm_external_last: float = 0.0  # the last scrape's own count
    vllm_external_steady: float = 0.0  # the smaller of the last two: seen in both
    # health and lifecycle
    consecutive_failures: int = 0
    restarts: int = 0
    last_error: str | None = None
    last_log_lines: list[str] = field(default_factory=list)
    pid: int | None = None
    gpus: list[int] | None = None
    state_since: float = field(default_factory=time.monotonic)
    ready_since: float | None = None
    swap_group: str | None = None  # workers of one group are never awake together
    asleep_s: float = 0.0  # time spent asleep before the current stretch
    # a swap group's pause (``/sleep?mode=keep``): since when its running requests are kept,
    # frozen in vLLM, until its wake resumes them (then None, and ``resumed_at`` that time)
    paused_since: float | None = None
    resumed_at: float = 0.0
    # KV-cache events (``workers/kvevents``): where they come from, and vLLM's cache settings
    # as its /metrics last showed them (block size, hash algorithm, prefix caching)
    kv_source: KvSource | None = None
    cache_info: CacheInfo | None = None

    @property
    def paused(self) -> int:
        """Requests of this gateway kept (frozen) on the worker by a pause: all in flight."""
        return self.inflight if self.paused_since is not None else 0

    def held_since(self) -> float:
        """The last time its requests were paused (infinity while they are; 0: never): a
        stream's idle deadline runs from then at the earliest."""
        return float("inf") if self.paused_since is not None else self.resumed_at

    @property
    def window(self) -> int | None:
        return self.max_model_len_override or self.max_model_len

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.ready and self.url is not None

    @property
    def busy(self) -> float:
        """Load against capacity counting, besides the gateway's own requests, the work vLLM
        showed beyond them at the last scrape: another replica's, a client going around the
        gateway (0..1+)."""
        return (self.inflight + self.vllm_external) / self.capacity if self.capacity else 1.0

    @property
    def busy_steady(self) -> float:
        """``busy`` with only the outside work seen in both of the last two scrapes: one scrape
        may list a request of the gateway's that vLLM had not yet dropped."""
        return (self.inflight + self.vllm_external_steady) / self.capacity if self.capacity else 1.0

    def set_state(self, state: WorkerState) -> None:
        if state is self.state:
            return
        now = time.monotonic()
        if self.state is WorkerState.asleep:
            self.asleep_s += now - self.state_since
        if self.paused_since is not None and state not in SLEEP_STATES:
            # however it left its sleep (its group's wake, a restart, a drain, a failure), its
            # requests are no longer kept: their idle deadline runs again from now
            self.paused_since, self.resumed_at = None, now
        self.state = state
        self.state_since = now
        self.ready_since = self.state_since if state is WorkerState.ready else None

    def time_asleep_s(self) -> float:
        """Seconds asleep in all, the current stretch included."""
        now = time.monotonic()
        return self.asleep_s + (now - self.state_since if self.state is WorkerState.asleep else 0)

    def uptime_s(self) -> float | None:
        return time.monotonic() - self.ready_since if self.ready_since is not None else None


Listener = Callable[[Worker, WorkerState], None]


class Registry:
    """Every configured worker by name, plus change listeners (metrics, admission wake-ups)."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._by_model: dict[str, list[Worker]] = {}  # the same workers, per model, in order
        self._listeners: list[Listener] = []
        self._idle: dict[str, asyncio.Event] = {}

    def add(self, worker: Worker) -> None:
        old = self._workers.get(worker.name)
        self._workers[worker.name] = worker
        if old is not None and old.model == worker.model:
            peers = self._by_model[old.model]
            peers[peers.index(old)] = worker
            return
        if old is not None:
            self._unlist(old)
        self._by_model.setdefault(worker.model, []).append(worker)

    def remove(self, name: str) -> Worker | None:
        worker = self._workers.pop(name, None)
        if worker is not None:
            self._unlist(worker)
        return worker

    def _unlist(self, worker: Worker) -> None:
        peers = self._by_model[worker.model]
        peers.remove(worker)
        if not peers:
            del self._by_model[worker.model]

    def get(self, name: str) -> Worker | None:
        return self._workers.get(name)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def of_model(self, model: str) -> list[Worker]:
        return list(self._by_model.get(model, ()))

    def ready_of_model(self, model: str) -> list[Worker]:
        return [w for w in self._by_model.get(model, ()) if w.routable]

    def serving_of_model(self, model: str) -> list[Worker]:
        """Workers that serve ``model`` now or once woken: ready, or in a sleep state (a
        request for a sleeping model waits in the queue while its worker is woken)."""
        return [
            w
            for w in self._by_model.get(model, ())
            if w.routable or (w.state in SLEEP_STATES and w.url is not None)
        ]

    def on_change(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def transition(self, worker: Worker, state: WorkerState) -> None:
        """Change a worker's state and tell listeners (old state passed along)."""
        old = worker.state
        if old is state:
            return
        worker.set_state(state)
        for listener in self._listeners:
            listener(worker, old)

    # ---- per-request counters: the one place they change ----------------------------------

    def started(self, name: str) -> None:
        """A request took a slot on ``name``."""
        w = self._workers.get(name)
        if w is not None:
            w.inflight += 1
            w.requests_total += 1

    def finished(self, name: str) -> None:
        """A request gave its slot on ``name`` back (exactly once per ``started``)."""
        w = self._workers.get(name)
        if w is None:
            return
        w.inflight = max(0, w.inflight - 1)
        if w.inflight == 0:
            event = self._idle.pop(name, None)
            if event is not None:
                event.set()

    def succeeded(self, name: str) -> None:
        """A request on ``name`` got an answer: its failure streak ends."""
        w = self._workers.get(name)
        if w is not None:
            w.consecutive_failures = 0

    def failed(self, name: str, reason: str, threshold: int) -> Worker | None:
        """A request could not reach ``name``. After ``threshold`` in a row an unsupervised
        ready worker is taken out (``failed``; its poller brings it back). Returns the worker."""
        w = self._workers.get(name)
        if w is None:
            return None
        w.consecutive_failures += 1
        w.last_error = reason
        if (
            w.consecutive_failures >= threshold
            and w.state is WorkerState.ready
            and (not w.supervised)
        ):
            self.transition(w, WorkerState.failed)
        return w

    def scraped(
        self, name: str, waiting: float, running: float, kv_usage: float, before: tuple[int, int]
    ) -> None:
        """``name``'s vLLM load as scraped; ``before`` is its ``(inflight, requests_total)``
        taken when the scrape was sent.

        Every request of this gateway that the scrape may show was in flight when it was sent
        or started while it ran, so what vLLM shows beyond those is someone else's work. The
        count is taken against that moment, not against the in-flight count when routing reads
        it: a scrape up to a period old still shows the gateway's requests that ended since,
        and counting those as load moved traffic for no reason (docs/performance.md).
        """
        w = self._workers.get(name)
        if w is None:
            return
        w.vllm_waiting, w.vllm_running, w.kv_usage = waiting, running, kv_usage
        inflight, total = before
        ours = inflight + (w.requests_total - total)
        # vLLM counts a request only once its API server has tokenized it, a good part of its
        # life on a busy worker: one scrape can miss outside work, so the larger of the last
        # two counts stands (a queue that emptied is forgotten one period later).
        seen = max(0.0, running + waiting - ours)
        last = w.vllm_external_last
        w.vllm_external, w.vllm_external_steady = max(seen, last), min(seen, last)
        w.vllm_external_last = seen

    async def wait_idle(self, worker: Worker, timeout_s: float) -> bool:
        """Wait until ``worker`` has nothing in flight (True) or ``timeout_s`` passes (False)."""
        if worker.inflight == 0:
            return True
        event = self._idle.setdefault(worker.name, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return worker.inflight == 0
        return True
