"""The poller for ``url:`` workers: health checks, windows, and vLLM load scrapes.

A worker is taken out (``failed``, with ``last_error``) after ``fail_threshold`` failed checks
in a row and put back (``ready``) as soon as a check passes again. Launched workers are the
supervisor's; this poller only scrapes their load.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp

from gpupool.config.models import RoutingConfig
from gpupool.workers.probe import probe, scrape_load
from gpupool.workers.registry import SLEEP_STATES, Registry, Worker, WorkerState

_NOT_MINE = frozenset({WorkerState.draining, WorkerState.stopped, *SLEEP_STATES})


class RemotePoller:
    def __init__(
        self, registry: Registry, session: aiohttp.ClientSession, cfg: RoutingConfig
    ) -> None:
        self.registry = registry
        self.session = session
        self.cfg = cfg
        self._tasks: list[asyncio.Task[None]] = []
        self._soon: set[asyncio.Task[None]] = set()  # first checks of workers that just joined
        # every probe and scrape holds a connection: at most this many at once
        self._slots = asyncio.Semaphore(cfg.probe_concurrency)
        self._unfiltered: set[str] = set()  # worker URLs that refuse the filtered metrics path
        # False for a swap group's member: its group brings it back (workers/swap), as only it
        # asks /is_sleeping; the poller checks it only while it is ready, to take it out.
        self.may_ready: Callable[[Worker], bool] = lambda _w: True

    async def start(self) -> None:
        await self.check_all()
        self._tasks = [
            asyncio.create_task(self._loop(self.check_all, self.cfg.health_interval_s)),
            asyncio.create_task(self._loop(self.scrape_all, self.cfg.metrics_interval_s)),
        ]

    async def close(self) -> None:
        tasks = [*self._tasks, *self._soon]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    def check_soon(self, w: Worker) -> None:
        """Check ``w`` in the background (a worker that just joined): whoever adds thousands
        at once is not held up by their probes, which take their turn for a slot."""
        task = asyncio.create_task(self.check(w))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)

    async def _loop(self, step: Callable[[], Awaitable[None]], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await step()

    async def check_all(self) -> None:
        workers = [w for w in self.registry if not w.supervised and w.url]
        await asyncio.gather(*(self.check(w) for w in workers))

    async def check(self, w: Worker) -> None:
        if w.state in _NOT_MINE or w.url is None:
            return  # drained, or the swap group's to change (asleep, waking, falling asleep)
        if w.state is not WorkerState.ready and not self.may_ready(w):
            return  # a swap group's member that is out: its group reads it (last_error too)
        async with self._slots:
            result = await probe(self.session, w.url, w.model, self.cfg.health_timeout_s)
        if w.state in _NOT_MINE:
            return  # drained (or put to sleep) while the probe ran: its answer is stale
        if result.ready:
            w.consecutive_failures = 0
            w.max_model_len = result.max_model_len
            if w.state is not WorkerState.ready:
                if not self.may_ready(w):
                    return
                w.last_error = None
                self.registry.transition(w, WorkerState.ready)
            return
        w.consecutive_failures += 1
        w.last_error = result.error
        if w.state is WorkerState.ready and w.consecutive_failures >= self.cfg.fail_threshold:
            self.registry.transition(w, WorkerState.failed)

    async def scrape_all(self) -> None:
        workers = [w for w in self.registry if w.routable]
        await asyncio.gather(*(self.scrape(w) for w in workers))

    async def scrape(self, w: Worker) -> None:
        assert w.url is not None
        before = (w.inflight, w.requests_total)
        async with self._slots:
            load = await scrape_load(self.session, w.url, unfiltered=self._unfiltered)
        if load is not None:
            if load.cache is not None:
                w.cache_info = load.cache
            self.registry.scraped(w.name, load.waiting, load.running, load.kv_usage, before)
