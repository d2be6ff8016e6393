"""The GPU-shaped engine (``gpupool sim --gpu``): vLLM's continuous batching in simulated time.

One scheduler task runs steps back to back while there is work, as vLLM's engine core does.
Before each step it admits waiting requests while fewer than ``max_num_seqs`` run and the KV
cache holds their whole length (reserved at admission, so nothing is ever preempted); each
admitted prompt first asks the prefix cache, whose hits are not computed again (a prompt's
blocks enter the cache, LRU-bounded, when its prefill is done). A step schedules
the running sequences in order within ``max_num_batched_tokens``: a decoding sequence costs one
token, a prefilling one a chunk of what is left of its prompt. The step lasts

    step_ms + seq_step_ms x sequences in it + prefill_ms_per_1k x prompt tokens computed / 1000

and then every decoding sequence has ``tokens_per_step`` more tokens, and one whose prompt is
done has its first. Steps keep their own clock: a late event loop runs the next steps shorter
until it is back on time (if it is less than :data:`CATCH_UP_S` late), so tokens/s are what
the shape says, not what a busy host allows.

A request that arrives while a step runs joins at the next step's start, as in vLLM. Counters
(prompt and generated tokens, prefix-cache queries and hits) and the TTFT and inter-token
histograms move at the step that causes them; the gauges read the scheduler's lists.

:meth:`StepEngine.abort_all` (a ``/sleep`` with ``mode=abort``) takes every sequence out of the
engine, running or waiting, as vLLM's ``finish_requests(None, FINISHED_ABORTED)`` does: each
request ends with the positions it had. A freeze (``mode=keep``) stops the steps: a step under
way when it came makes nothing, and the next one runs after the thaw.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import AbstractAsyncContextManager
from types import TracebackType

from gpupool.workers.sim.cache import BLOCK_SIZE, PrefixCache
from gpupool.workers.sim.config import GpuShape, SimConfig
from gpupool.workers.sim.engine import Admission, Engine, Gauges, Pacer, Stats
from gpupool.workers.sim.faults import Knobs

CATCH_UP_S = 0.5  # a loop later than this (a stalled host) starts its next step afresh


class Seq:
    """One request inside the engine: its prompt progress, its output positions, who waits."""

    __slots__ = (
        "aborted",
        "adm",
        "computed",
        "done",
        "first_at",
        "last_at",
        "lens",
        "produced",
        "prompt",
        "reserved",
        "total",
        "waiter",
    )

    def __init__(self, adm: Admission) -> None:
        self.adm = adm
        self.prompt = len(adm.prompt_pieces)
        self.lens = adm.output_lens or (adm.planned_tokens,)
        self.total = max(1, *self.lens)  # output positions (the longest choice)
        self.computed = 0  # prompt tokens in the KV cache (prefix hits included)
        self.produced = 0  # output positions made
        self.reserved = 0  # KV blocks held for its whole length
        self.done = False
        self.aborted = False
        self.first_at = 0.0
        self.last_at = 0.0
        self.waiter: asyncio.Future[None] | None = None

    @property
    def blocks_used(self) -> int:
        return -(-(self.computed + self.produced) // BLOCK_SIZE)

    def advance(self, positions: int) -> int:
        """Make up to ``positions`` more output positions; the tokens that adds (all choices)."""
        old, new = self.produced, min(self.total, self.produced + positions)
        self.produced = new
        return sum(min(n, new) - min(n, old) for n in self.lens)

    def wake(self) -> None:
        fut = self.waiter
        if fut is not None:
            self.waiter = None
            if not fut.done():
                fut.set_result(None)


class StepEngine(Engine):
    """:class:`Engine` with vLLM's scheduler in place of one timer per request."""

    def __init__(self, config: SimConfig, knobs: Knobs) -> None:
        assert config.gpu is not None
        self.shape: GpuShape = config.gpu
        self.max_num_seqs = config.max_num_seqs
        self.waiting: deque[Seq] = deque()
        self.scheduled: list[Seq] = []  # vLLM's running list
        self._reserved = 0
        self._task: asyncio.Task[None] | None = None
        super().__init__(config, knobs)
        if self.shape.num_gpu_blocks is not None:
            self.cache = PrefixCache(self.shape.num_gpu_blocks)

    def _gauges(self) -> Gauges:
        return (
            lambda: float(len(self.scheduled)),
            lambda: float(len(self.waiting)),
            lambda: min(1.0, sum(s.blocks_used for s in self.scheduled) / self.cache.num_blocks),
        )

    def would_block(self, hold_s: float) -> bool:
        return True  # every token waits for a step

    def running(self, adm: Admission) -> AbstractAsyncContextManager[Pacer]:
        return StepRunning(self, adm)

    def reset_stats(self) -> None:
        self.stats = Stats(peak_running=len(self.scheduled))

    def stats_payload(self) -> dict[str, object]:
        payload = super().stats_payload()
        payload["running"], payload["waiting"] = len(self.scheduled), len(self.waiting)
        return payload

    # -- the request's side -----------------------------------------------------------------

    def abort_all(self) -> None:
        self.aborts += 1
        for seq in [*self.waiting, *self.scheduled]:
            self._abort(seq)

    def _abort(self, seq: Seq) -> None:
        seq.aborted = True
        self._drop(seq)
        seq.wake()

    def enqueue(self, adm: Admission, epoch: int | None = None) -> Seq:
        """Queue a request; one that came in before an abort (``epoch``: :attr:`aborts` when
        it did) is aborted at once."""
        seq = Seq(adm)
        self.stats.request_ids.append(adm.tracking_id)
        self.stats.prompts.append(adm.label)
        if epoch is not None and epoch != self.aborts:
            seq.aborted = seq.done = True
            return seq
        self.waiting.append(seq)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._steps())
        return seq

    def leave(self, seq: Seq, reasons: list[str] | None) -> None:
        """The request's body ended: ``reasons`` after its last position, None on an error or
        a cancellation (an abort: the sequence leaves the engine if it is still there)."""
        aborted = reasons is None or not seq.done or seq.aborted
        if aborted:
            self._drop(seq)
        m = self.metrics
        for reason in ["abort"] if aborted or reasons is None else reasons:
            m.success[reason] += 1
        m.e2e.observe(time.monotonic() - seq.adm.arrival if seq.adm.arrival else 0.0)
        if aborted:
            self.stats.aborted_total += 1
        else:
            self.stats.completed_total += 1

    def _drop(self, seq: Seq) -> None:
        seq.done = True
        if seq in self.scheduled:
            self.scheduled.remove(seq)
            self._reserved -= seq.reserved
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # -- the scheduler ----------------------------------------------------------------------

    async def _steps(self) -> None:
        try:
            end = 0.0
            first = True
            while self.waiting or self.scheduled:
                await self.knobs.wait_unhung()
                await self.wait_thawed()
                now = time.monotonic()
                self._admit(now)
                batch = self._schedule()
                duration = self._duration(batch)
                start = now if first or now - end > CATCH_UP_S else end  # a late loop catches up
                first = False
                end = start + duration
                await asyncio.sleep(max(0.0, end - time.monotonic()))
                if self.frozen_at is not None:  # paused during the step: it made nothing
                    first = True
                    continue
                self._finish(batch, time.monotonic())
        finally:
            self._task = None

    def _admit(self, now: float) -> None:
        m = self.metrics
        while self.waiting and len(self.scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            need = -(-(seq.prompt + seq.total) // BLOCK_SIZE)
            if self.scheduled and self._reserved + need > self.cache.num_blocks:
                return  # vLLM waits for blocks to free
            self.waiting.popleft()
            hits = self.cache.lookup(seq.adm.prompt_pieces, seq.adm.blocks)
            seq.computed, seq.reserved = hits, need
            self._reserved += need
            self.scheduled.append(seq)
            counters = m.counters
            counters["prompt_tokens"] += seq.prompt
            counters["prefix_cache_queries"] += seq.prompt
            counters["prefix_cache_hits"] += hits
            m.queue_time.observe(now - seq.adm.arrival if seq.adm.arrival else 0.0)
            self.stats.peak_running = max(self.stats.peak_running, len(self.scheduled))

    def _schedule(self) -> list[tuple[Seq, int]]:
        """``(sequence, prompt tokens computed)`` for this step; 0 means one decode."""
        budget = self.shape.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        for seq in self.scheduled:
            if budget <= 0:
                break
            chunk = min(seq.prompt - seq.computed, budget)
            batch.append((seq, max(chunk, 0)))
            budget -= max(chunk, 1)
        return batch

    def _duration(self, batch: list[tuple[Seq, int]]) -> float:
        g = self.shape
        prefill = sum(chunk for _, chunk in batch)
        ms = g.step_ms + g.seq_step_ms * len(batch) + g.prefill_ms_per_1k * prefill / 1000.0
        return ms / 1000.0

    def _finish(self, batch: list[tuple[Seq, int]], now: float) -> None:
        m = self.metrics
        made = 0
        for seq, chunk in batch:
            if seq.done:
                continue  # aborted during the step
            if chunk:
                seq.computed += chunk
                if seq.computed < seq.prompt:
                    continue
                self.cache.insert(seq.adm.prompt_pieces, seq.adm.blocks)  # for the next prompts
                made += seq.advance(1)  # the step that ends a prompt samples its first token
            else:
                made += seq.advance(self.shape.tokens_per_step)
            if seq.first_at == 0.0:
                seq.first_at = now
                m.ttft.observe(now - (seq.adm.arrival or now))
            else:
                m.itl.observe(now - seq.last_at)
            seq.last_at = now
            if seq.produced >= seq.total:
                seq.done = True
                self.scheduled.remove(seq)
                self._reserved -= seq.reserved
            seq.wake()
        m.counters["generation_tokens"] += made


class StepRun:
    """A request's view of its sequence: waits for the steps that make its positions."""

    __slots__ = ("engine", "finish_reasons", "generated", "seq")

    def __init__(self, engine: StepEngine, seq: Seq) -> None:
        self.engine = engine
        self.seq = seq
        self.generated = 0
        self.finish_reasons: list[str] = []

    async def pace(self, step: int) -> None:
        await self.engine.knobs.wait_unhung()
        await self._until(step + 1)

    async def pace_all(self, steps: int) -> None:
        await self.engine.knobs.wait_unhung()
        await self._until(steps)

    def available(self, step: int, steps: int) -> int:
        return max(step + 1, min(self.seq.produced, steps))

    @property
    def aborted(self) -> bool:
        return self.seq.aborted

    def made(self, steps: int) -> int:
        return min(self.seq.produced, steps)

    async def _until(self, positions: int) -> None:
        seq = self.seq
        while seq.produced < min(positions, seq.total) and not seq.done:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            seq.waiter = fut
            await fut


class StepRunning:
    """``async with``: queue the request in the engine; on exit, count it (or abort it)."""

    __slots__ = ("_adm", "_engine", "_epoch", "_run")

    def __init__(self, engine: StepEngine, adm: Admission) -> None:
        self._engine = engine
        self._adm = adm
        self._epoch = engine.aborts
        self._run: StepRun | None = None

    async def __aenter__(self) -> Pacer:
        if self._adm.hold_s > 0:
            await asyncio.sleep(self._adm.hold_s)
        self._run = StepRun(self._engine, self._engine.enqueue(self._adm, self._epoch))
        return self._run

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        run = self._run
        assert run is not None
        reasons = None if exc_type is not None else (run.finish_reasons or ["stop"])
        self._engine.leave(run.seq, reasons)
