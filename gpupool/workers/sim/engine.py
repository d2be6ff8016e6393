"""The simulated engine: capacity (``max_num_seqs``), timing, KV usage, stats and metrics.

No HTTP here. A request *runs* between :meth:`Engine.running`'s enter and exit: it takes a slot
(waiting in FIFO order when all are busy), its tokens are paced with :meth:`Run.pace`, and the
slot is given back on exit, counted as an abort when the body raised or was cancelled.

:meth:`Engine.abort_all` is vLLM's abort of every request (a ``/sleep`` with ``mode=abort``):
each request in the engine, running or waiting for a slot, ends at its next position with what
it made so far (its pacing wakes at once; the body reads :attr:`Pacer.aborted`).
:meth:`Engine.freeze` and :meth:`Engine.thaw` are vLLM's pause of its scheduler (a ``/sleep``
with ``mode=keep``) and its resume at the wake: no request makes a token in between, and each
goes on after the thaw where it was, its due times moved by the time it was frozen.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from gpupool.workers.sim.cache import BLOCK_SIZE, PrefixCache
from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.faults import Knobs
from gpupool.workers.sim.metrics import SimMetrics

if TYPE_CHECKING:
    from gpupool.workers.sim.kvevents import Blocks


@dataclass(slots=True)
class Admission:
    """What the engine needs to know about a request."""

    tracking_id: str
    prompt_pieces: list[str]
    planned_tokens: int
    hold_s: float = 0.0
    arrival: float = 0.0
    output_lens: tuple[int, ...] = ()  # each choice's planned tokens (the GPU engine's pace)
    label: str = ""  # the prompt's start, for /sim/stats (a gateway replaces request ids)
    blocks: Blocks | None = None  # vLLM's block hashes of the prompt (KV events on)


class Pacer(Protocol):
    """What a request's body sees of the engine while it runs (:meth:`Engine.running`)."""

    generated: int
    finish_reasons: list[str]

    @property
    def aborted(self) -> bool:
        """Whether the engine aborted the request (:meth:`Engine.abort_all`): it ends now."""

    def made(self, steps: int) -> int:
        """Output positions (of ``steps``) made by now, or by the abort."""

    async def pace(self, step: int) -> None:
        """Wait until output position ``step`` (0-based, per choice) is due."""

    async def pace_all(self, steps: int) -> None:
        """Wait until the last of ``steps`` positions is due (a non-streaming request)."""

    def available(self, step: int, steps: int) -> int:
        """After ``pace(step)``: positions up to this one (exclusive) are ready to send."""


Gauges = tuple[Callable[[], float], Callable[[], float], Callable[[], float]]


@dataclass(slots=True)
class Stats:
    peak_running: int = 0
    requests_total: int = 0
    aborted_total: int = 0
    completed_total: int = 0
    request_ids: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # each started request's ``label``


class Slots:
    """A FIFO semaphore that can tell whether taking a slot would wait."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def free(self) -> bool:
        return self.running < self.limit and not self._waiters

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def take(self) -> None:
        if self.free:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # a releasing request hands its slot over: running stays the same
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


class Engine:
    def __init__(self, config: SimConfig, knobs: Knobs) -> None:
        self.knobs = knobs
        self.slots = Slots(config.max_num_seqs)
        self.stats = Stats()
        self.aborts = 0  # abort_all() calls: a request that entered before one is aborted
        self.frozen_at: float | None = None  # freeze(): no token until thaw()
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._runs: set[Run] = set()
        blocks_per_seq = math.ceil(config.max_model_len / BLOCK_SIZE)
        self.cache = PrefixCache(config.max_num_seqs * blocks_per_seq)
        self._kv_capacity = self.cache.num_blocks * BLOCK_SIZE
        self._kv_tokens = 0
        running, waiting, kv_usage = self._gauges()
        self.metrics = SimMetrics(
            config.served_names[0], running=running, waiting=waiting, kv_usage=kv_usage
        )

    def _gauges(self) -> Gauges:
        """vLLM's running, waiting and KV-usage gauges, read at scrape time."""
        return (
            lambda: float(self.slots.running),
            lambda: float(self.slots.waiting),
            lambda: min(1.0, self._kv_tokens / self._kv_capacity),
        )

    def would_block(self, hold_s: float) -> bool:
        """True when running a request now would await anything (a slot, a delay, a hang)."""
        k = self.knobs
        return k.hang or k.ttft_ms > 0 or k.itl_ms > 0 or hold_s > 0 or not self.slots.free

    def running(self, adm: Admission) -> AbstractAsyncContextManager[Pacer]:
        """``async with engine.running(adm) as run:`` holds a slot for the body's duration."""
        return Running(self, adm)

    def abort_all(self) -> None:
        """Abort every request in the engine: those waiting for a slot too (they end as soon
        as they get one, which the aborted ones give back at once)."""
        self.aborts += 1
        for run in self._runs:
            run.abort()

    def freeze(self) -> None:
        """Pause every request: none makes a token until :meth:`thaw`."""
        if self.frozen_at is None:
            self.frozen_at = time.monotonic()
            self._thawed.clear()

    def thaw(self) -> None:
        """Resume them: each one's next tokens are due as late as it was frozen."""
        if self.frozen_at is None:
            return
        now = time.monotonic()
        for run in self._runs:
            run.postpone(now - max(self.frozen_at, run.started))
        self.frozen_at = None
        self._thawed.set()

    async def wait_thawed(self) -> None:
        await self._thawed.wait()

    def _begin(self, adm: Admission) -> Run:
        now = time.monotonic()
        stats = self.stats
        stats.request_ids.append(adm.tracking_id)
        stats.prompts.append(adm.label)
        stats.peak_running = max(stats.peak_running, self.slots.running)
        m = self.metrics
        m.queue_time.observe(now - adm.arrival if adm.arrival else 0.0)
        prompt = len(adm.prompt_pieces)
        counters = m.counters
        counters["prompt_tokens"] += prompt
        counters["prefix_cache_queries"] += prompt
        counters["prefix_cache_hits"] += self.cache.query(adm.prompt_pieces, adm.blocks)
        self._kv_tokens += prompt + adm.planned_tokens
        k = self.knobs
        run = Run(self, adm, now, k.ttft_ms / 1000.0, k.itl_ms / 1000.0)
        self._runs.add(run)
        return run

    def _end(self, run: Run, reasons: Sequence[str]) -> None:
        self._runs.discard(run)
        self.slots.release()
        self._kv_tokens -= len(run.adm.prompt_pieces) + run.adm.planned_tokens
        m = self.metrics
        for reason in reasons:
            m.success[reason] += 1
        m.counters["generation_tokens"] += run.generated
        m.e2e.observe(time.monotonic() - (run.adm.arrival or run.started))
        if reasons[0] == "abort":
            self.stats.aborted_total += 1
        else:
            self.stats.completed_total += 1

    def reset_stats(self) -> None:
        self.stats = Stats(peak_running=self.slots.running)

    def stats_payload(self) -> dict[str, Any]:
        s = self.stats
        return {
            "running": self.slots.running,
            "waiting": self.slots.waiting,
            "peak_running": s.peak_running,
            "requests_total": s.requests_total,
            "aborted_total": s.aborted_total,
            "completed_total": s.completed_total,
            "request_ids": s.request_ids,
            "prompts": s.prompts,
        }


class Running:
    """The context manager of :meth:`Engine.running`; an exception in the body is an abort."""

    __slots__ = ("_adm", "_engine", "_epoch", "_run")

    def __init__(self, engine: Engine, adm: Admission) -> None:
        self._engine = engine
        self._adm = adm
        self._epoch = engine.aborts
        self._run: Run | None = None

    async def __aenter__(self) -> Run:
        await self._engine.slots.take()
        self._run = run = self._engine._begin(self._adm)
        if self._engine.aborts != self._epoch:  # aborted while it waited for its slot
            run.abort(run.started)
        return run

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run = self._run
        assert run is not None
        aborted = exc_type is not None or run.aborted
        reasons = ["abort"] if aborted else (run.finish_reasons or ["stop"])
        self._engine._end(run, reasons)


class Run:
    """One request holding a slot: paces its tokens and records what it generated."""

    __slots__ = (
        "_aborted_at",
        "_due0",
        "_itl",
        "_last",
        "_waiter",
        "adm",
        "engine",
        "finish_reasons",
        "generated",
        "started",
    )

    def __init__(self, engine: Engine, adm: Admission, started: float, ttft: float, itl: float):
        self.engine = engine
        self.adm = adm
        self.started = started
        self._due0 = started + adm.hold_s + ttft
        self._itl = itl
        self._last = 0.0
        self.generated = 0
        self.finish_reasons: list[str] = []
        self._aborted_at: float | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def aborted(self) -> bool:
        return self._aborted_at is not None

    def abort(self, at: float | None = None) -> None:
        if self._aborted_at is None:
            self._aborted_at = time.monotonic() if at is None else at
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def postpone(self, seconds: float) -> None:
        """Its tokens to come are due ``seconds`` later (it was frozen that long)."""
        self._due0 += max(seconds, 0.0)

    def made(self, steps: int) -> int:
        at = self._aborted_at or time.monotonic()  # position k is due at _due0 + k * _itl
        frozen = self.engine.frozen_at
        at = at if frozen is None else min(at, frozen)
        if at <= self._due0:
            return 0
        return steps if self._itl <= 0 else min(steps, math.ceil((at - self._due0) / self._itl))

    async def pace(self, step: int) -> None:
        """Wait until token ``step`` (0-based, per choice) is due; record TTFT / ITL."""
        await self.engine.knobs.wait_unhung()
        await self._due(lambda: self._due0 + step * self._itl)
        if self.aborted:
            return
        now = time.monotonic()
        m = self.engine.metrics
        if step == 0:
            m.ttft.observe(now - (self.adm.arrival or self.started))
        else:
            m.itl.observe(now - self._last)
        self._last = now

    async def pace_all(self, steps: int) -> None:
        """Wait until the last of ``steps`` tokens is due (a non-streaming request)."""
        await self.engine.knobs.wait_unhung()
        await self._due(lambda: self._due0 + max(steps - 1, 0) * self._itl)
        if self.aborted and self.made(steps) == 0:
            return  # no first token: no TTFT
        first = min(self._due0, time.monotonic())
        self.engine.metrics.ttft.observe(first - (self.adm.arrival or self.started))

    def available(self, step: int, steps: int) -> int:
        return step + 1  # one position at a time, each at its own due time

    async def _due(self, due: Callable[[], float]) -> None:
        """Wait until ``due()`` (moved by a freeze) has passed while the engine is not frozen."""
        engine = self.engine
        while True:
            if engine.frozen_at is not None and not self.aborted:
                await engine.wait_thawed()
            await self._sleep(due() - time.monotonic())
            if engine.frozen_at is None or self.aborted:
                return

    async def _sleep(self, delay: float) -> None:
        """``asyncio.sleep(delay)`` that :meth:`abort` ends early (as cheap: one timer)."""
        if delay <= 0 or self.aborted:
            return
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(delay, _set_unless_done, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _set_unless_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
