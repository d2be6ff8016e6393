"""One swap group: workers that take turns on one GPU, never two awake at once.

The group's *holder* is the one member that may use the GPU (awake, waking, starting, or
falling asleep); every other member is asleep, or waits at its launch gate (a launched worker
starting or restarting only launches while it holds the GPU). A switch, under the group's lock:

    holder ready ──▶ falling_asleep (no new requests; running ones finish, however long)
                 ──▶ POST /sleep?level=N&mode=wait ──▶ asleep      (holder: none)
    target asleep ─▶ waking ──▶ POST /wake_up (level 2: + reload_weights) ──▶ ready
    target at its launch gate ──▶ launched, ready                  (holder: target)

The next member is woken only after the last one's /sleep answered (or its process was killed),
and admission grants slots only on ``ready`` workers, so no request reaches a sleeping worker.
A failed sleep or wake marks the worker failed; a launched one is restarted as supervision
restarts a crash (its relaunch waits at the gate for its turn).

Start-up: ``url:`` members are asked ``/is_sleeping``; the first awake one keeps the GPU and any
other awake one is put to sleep. Launched members start one after another, each put to sleep once
ready (vLLM sizes its KV cache from the free memory it finds), the group's first one last, so it
ends awake. Then the loop: every ``tick_s`` the policy (``policy.py``) says whose turn it is, and
an idle holder with ``sleep.idle_s`` is put to sleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from gpupool.workers import probe as probes
from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.swap import client
from gpupool.workers.swap.client import SleepCallFailed
from gpupool.workers.swap.demand import Demand, ModelDemand
from gpupool.workers.swap.policy import Holder, Turns, next_model

log = logging.getLogger("gpupool.swap")

_POLL_S = 0.05
_UP = (WorkerState.ready, WorkerState.failed)


def state_of(w: Worker) -> WorkerState:
    """``w.state`` now (it changes across awaits; a call keeps mypy from assuming otherwise)."""
    return w.state


class SwapEvents(Protocol):
    def switched(self, group: str, model: str, seconds: float, waited: int) -> None:
        """The GPU went to ``model`` after ``seconds``; ``waited`` requests were waiting."""
        ...


@dataclass(slots=True)
class Member:
    worker: Worker
    level: int
    idle_s: float | None
    launched: bool
    slept_at: int | None = None  # the level of its current sleep (an admin may pick another)
    next_level: int | None = None  # the level of its next sleep only (admin ``?level=``)


@dataclass(frozen=True, slots=True)
class GroupSeams:
    registry: Registry
    session: aiohttp.ClientSession
    demand: Demand
    events: SwapEvents
    restart: Callable[[str], Awaitable[None]] | None  # the supervisor's, for launched workers
    turns: Turns
    sleep_timeout_s: float
    wake_timeout_s: float
    probe_timeout_s: float = 10.0
    tick_s: float = 0.1


class SwapGroup:
    def __init__(self, name: str, members: list[Member], seams: GroupSeams) -> None:
        self.name = name
        self.members = members
        self.seams = seams
        self.holder: Member | None = None
        self.lock = asyncio.Lock()
        self.starting_up = True
        self._leaving: Member | None = None  # the holder while it falls asleep
        self._awake_since = time.monotonic()
        self._last_active = time.monotonic()
        self._seen_total = -1

    def member(self, name: str) -> Member | None:
        return next((m for m in self.members if m.worker.name == name), None)

    # -- seams for the supervisor and the poller ----------------------------------------------

    def may_run(self, member: Member) -> bool:
        """Whether ``member`` may use the GPU now (launch, or be marked ready by the poller)."""
        if self.holder is None and not self.starting_up and not self.lock.locked():
            self.holder = member  # a free GPU: a relaunch after a failure takes it
            self._awake_since = time.monotonic()
        return self.holder is member and self._leaving is not member

    def refresh(self) -> None:
        """Follow the registry's entries: a reload replaces a changed worker's (same name)."""
        for m in self.members:
            current = self.seams.registry.get(m.worker.name)
            if current is not None and current is not m.worker:
                current.swap_group = self.name
                m.worker = current

    def holds(self, member: Member) -> bool:
        """Whether ``member`` holds the GPU now (the poller may mark it ready). A ``url:``
        member that failed comes back through a switch, which asks it ``/is_sleeping``."""
        return self.holder is member and self._leaving is not member

    async def before_launch(self, member: Member) -> None:
        """The launch gate: return once ``member`` holds the GPU."""
        self.refresh()
        while not self.may_run(member):
            member.worker.last_error = f"waiting for its turn on the GPU (swap group {self.name})"
            await asyncio.sleep(_POLL_S * 2)
        if member.worker.last_error and member.worker.last_error.startswith("waiting for its turn"):
            member.worker.last_error = None

    # -- start-up and the loop ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with self.lock:
                await self._start_up()
        finally:
            self.starting_up = False
        while True:
            await asyncio.sleep(self.seams.tick_s)
            try:
                async with self.lock:
                    await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the group's turns for good
                log.exception("swap group %s: step failed", self.name)

    async def _start_up(self) -> None:
        remote = [m for m in self.members if not m.launched]
        awake = await asyncio.gather(*(self._read_remote(m) for m in remote))
        for m, is_awake in zip(remote, awake, strict=True):
            if not is_awake:
                continue
            if self.holder is None:
                self.holder = m
                self._mark_ready(m)
            else:
                log.info("swap group %s: %s is awake too; putting it to sleep", self.name,
                         m.worker.name)  # fmt: skip
                await self._sleep_call(m)
        launched = [m for m in self.members if m.launched]
        if not launched:
            return
        last = launched[0] if self.holder is None else None
        for m in [x for x in launched if x is not last] + ([last] if last else []):
            if self.holder is not None and self.holder is not m:
                await self._put_to_sleep(self.holder)
            self.holder = m
            self._awake_since = time.monotonic()
            await self._until(m.worker, _UP)
            if m is not last and m.worker.state is WorkerState.ready:
                await self._put_to_sleep(m)
        if self.holder is not None and self.holder.worker.state is not WorkerState.ready:
            self.holder = None

    async def _read_remote(self, m: Member) -> bool:
        """A ``url:`` member's window and sleep state; True when it is awake and serving."""
        w, seams = m.worker, self.seams
        assert w.url is not None
        result = await probes.probe(seams.session, w.url, w.model, seams.probe_timeout_s)
        if not result.ready:
            w.last_error = result.error
            return False
        w.max_model_len = result.max_model_len
        asleep = await client.is_sleeping(seams.session, w.url, seams.probe_timeout_s)
        if asleep:
            self.seams.registry.transition(w, WorkerState.asleep)
            return False
        return True

    async def _step(self) -> None:
        self.refresh()
        h, now = self.holder, time.monotonic()
        if h is not None and h.worker.state is not WorkerState.ready:
            if h.worker.state in (WorkerState.failed, WorkerState.stopped):
                self.holder = None  # its process is gone (or a url worker is out): GPU free
            return  # else (re)starting: let it come up
        if h is not None and (h.worker.inflight or h.worker.requests_total != self._seen_total):
            self._last_active, self._seen_total = now, h.worker.requests_total
        demand = self._demand(now)
        view = None
        if h is not None:
            view = Holder(h.worker.model, now - self._awake_since, h.worker.inflight > 0)
        model = next_model(view, demand, self.seams.turns)
        target = self._target(model) if model is not None else None
        if target is not None:
            await self.switch_to(target)
        elif self._idle_for(h, demand, now):
            assert h is not None
            log.info("swap group %s: %s idle for %g s; sleeping", self.name, h.worker.name,
                     h.idle_s)  # fmt: skip
            await self._put_to_sleep(h)

    def _idle_for(self, h: Member | None, demand: dict[str, ModelDemand], now: float) -> bool:
        """Whether the holder has been idle for its ``sleep.idle_s``."""
        if h is None or h.idle_s is None or h.worker.model in demand:
            return False
        return now - self._last_active >= h.idle_s

    def _demand(self, now: float) -> dict[str, ModelDemand]:
        out = {}
        for model in {m.worker.model for m in self.members}:
            d = self.seams.demand.of(model, now)
            if d is not None:
                out[model] = d
        return out

    def _target(self, model: str) -> Member | None:
        """The member to wake for ``model``: an asleep one, else one waiting at its gate."""
        for states in ((WorkerState.asleep,), (WorkerState.starting, WorkerState.failed)):
            for m in self.members:
                w = m.worker
                if w.model != model or w.state not in states:
                    continue
                if w.state is WorkerState.failed and m.launched:
                    continue  # supervision gave up on it
                return m
        return None

    # -- switching ----------------------------------------------------------------------------

    async def switch_to(self, target: Member) -> bool:
        """Give the GPU to ``target`` (caller holds the lock). True when it ends ready."""
        t0 = time.monotonic()
        old = self.holder
        if old is target and target.worker.state is WorkerState.ready:
            return True
        if old is not None and old is not target and not await self._put_to_sleep(old):
            return False
        self.holder = target
        self._awake_since = time.monotonic()
        if not await self._wake(target):
            return False
        self._awake_since = self._last_active = time.monotonic()
        waited = self.seams.demand.count(target.worker.model)
        log.info("swap group %s: %s awake after %.2f s (%d waiting)", self.name,
                 target.worker.name, self._awake_since - t0, waited)  # fmt: skip
        self.seams.events.switched(self.name, target.worker.model, self._awake_since - t0, waited)
        return True

    async def put_to_sleep(self, m: Member) -> bool:
        """Admin: put ``m`` to sleep if it holds the GPU (caller holds the lock)."""
        if self.holder is not m:
            return m.worker.state is WorkerState.asleep
        return await self._put_to_sleep(m)

    async def _put_to_sleep(self, m: Member) -> bool:
        """Stop new requests, let the running ones finish, /sleep. True when the GPU is free."""
        w, registry = m.worker, self.seams.registry
        self._leaving = m
        try:
            if w.state in (WorkerState.starting, WorkerState.warming) and m.launched:
                await self._until(w, (*_UP, WorkerState.stopped))
            if w.state is WorkerState.ready:
                registry.transition(w, WorkerState.falling_asleep)
                while w.inflight > 0 and state_of(w) is WorkerState.falling_asleep:
                    await registry.wait_idle(w, 1.0)
                if state_of(w) is WorkerState.falling_asleep:
                    freed = await self._sleep_call(m)
                    if not freed:
                        return False
            elif w.state is not WorkerState.asleep and not m.launched:
                return w.state in (WorkerState.failed, WorkerState.stopped, WorkerState.starting)
            self.holder = None if self.holder is m else self.holder
            return True
        finally:
            self._leaving = None

    async def _sleep_call(self, m: Member) -> bool:
        w, seams = m.worker, self.seams
        assert w.url is not None
        level, m.next_level = m.next_level or m.level, None
        try:
            await client.sleep(seams.session, w.url, level, seams.sleep_timeout_s)
            m.slept_at = level
        except SleepCallFailed as e:
            return await self._failed(m, f"sleep failed: {e}")
        if w.state in (WorkerState.falling_asleep, WorkerState.ready) or not m.launched:
            seams.registry.transition(w, WorkerState.asleep)  # (a url: one found awake at start)
        return True

    async def _wake(self, m: Member) -> bool:
        w, seams = m.worker, self.seams
        if w.state is WorkerState.asleep and w.url is not None:
            seams.registry.transition(w, WorkerState.waking)
            try:
                await client.wake(seams.session, w.url, m.slept_at or m.level,
                                  seams.wake_timeout_s)  # fmt: skip
            except SleepCallFailed as e:
                await self._failed(m, f"wake failed: {e}")
                if m.launched:  # restarted: it comes up awake, as its turn goes on
                    await self._until(w, _UP)
                return state_of(w) is WorkerState.ready
            if state_of(w) is WorkerState.waking:
                self._mark_ready(m)
            return state_of(w) is WorkerState.ready
        if m.launched:  # at its launch gate (or restarting): now its turn
            await self._until(w, _UP)
            return state_of(w) is WorkerState.ready
        return await self._wake_remote(m)

    async def _wake_remote(self, m: Member) -> bool:
        """A ``url:`` member that was out (starting or failed): awake it if it sleeps."""
        w = m.worker
        if w.url is None or not await self._read_remote_awake(m):
            return False
        self._mark_ready(m)
        return True

    async def _read_remote_awake(self, m: Member) -> bool:
        w, seams = m.worker, self.seams
        assert w.url is not None
        result = await probes.probe(seams.session, w.url, w.model, seams.probe_timeout_s)
        if not result.ready:
            w.last_error = result.error
            return False
        if await client.is_sleeping(seams.session, w.url, seams.probe_timeout_s):
            try:
                await client.wake(seams.session, w.url, m.slept_at or m.level,
                                  seams.wake_timeout_s)  # fmt: skip
            except SleepCallFailed as e:
                await self._failed(m, f"wake failed: {e}")
                return False
        w.max_model_len = result.max_model_len
        return True

    def _mark_ready(self, m: Member) -> None:
        m.worker.consecutive_failures = 0
        self.seams.registry.transition(m.worker, WorkerState.ready)

    async def _failed(self, m: Member, reason: str) -> bool:
        """Mark ``m`` failed; restart a launched one. True when its GPU memory is free."""
        w = m.worker
        log.warning("swap group %s: worker %s: %s", self.name, w.name, reason)
        w.last_error = reason
        self.seams.registry.transition(w, WorkerState.failed)
        if not m.launched or self.seams.restart is None:
            return False
        await self.seams.restart(w.name)  # kills the process: its memory is free
        await self._until(w, (WorkerState.starting, WorkerState.warming, *_UP), 10.0)
        return True

    async def _until(
        self, w: Worker, states: tuple[WorkerState, ...], timeout_s: float | None = None
    ) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while w.state not in states:
            if deadline is not None and time.monotonic() >= deadline:
                return
            await asyncio.sleep(_POLL_S)
