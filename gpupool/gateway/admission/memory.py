"""Memory admission: one gateway process, exact, no I/O.

State: per worker the slots held, in all and per tenant; per model a queue of waiters in
``fairness`` order and the tenants active lately (for reserved seats, see ``fairness``); per
worker the same waiters again, restricted to those whose ``candidates`` include it.

Invariant: after every operation, no worker with room (available and held < capacity) has an
eligible waiter that may take the slot (a tenant at its limit while others are active may not;
once the others' window lapses it may again, from the next release or arrival on that worker).
``acquire``, ``release`` and ``poke`` keep it by handing slots out synchronously (no ``await``
between a slot freeing and a waiter getting it), so a wake-up cannot be lost. A
granted slot is counted at grant time, before the waiter resumes; if the waiter was cancelled in
between, its cleanup gives the slot back (``_abandon``), so a slot is never leaked.

The Redis backend also uses this class as its fallback while Redis is unreachable, through
:meth:`MemoryAdmission.force_hold` (count a slot taken elsewhere) and
:meth:`MemoryAdmission.requeue_all` (send waiters back to Redis once it returns).
"""

from __future__ import annotations

import asyncio
import itertools
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gpupool.config.models import QueueConfig
from gpupool.gateway.admission.base import Lease, Ticket, WaitCallback, WorkerView
from gpupool.gateway.admission.fairness import (
    RESERVE_SCAN,
    DrainRate,
    FairClock,
    OrderKey,
    Presence,
    retry_after,
    shared_limit,
    tenant_limit,
)
from gpupool.gateway.admission.waiting import consume, wait_for_grant
from gpupool.gateway.errors import QueueFull, QueueTimeout, ServiceUnavailable


class Requeued(Exception):
    """The waiter was taken out of this queue to be queued again elsewhere."""


@dataclass(eq=False, slots=True)
class _Waiter:
    ticket: Ticket
    key: OrderKey
    candidates: tuple[str, ...]
    fut: asyncio.Future[str]
    since: float
    queued: bool = True
    lid: str | None = None  # the lease id once granted


def _key(waiter: _Waiter) -> OrderKey:
    return waiter.key


def _remove(waiters: list[_Waiter], waiter: _Waiter) -> None:
    i = bisect_left(waiters, waiter.key, key=_key)
    while waiters[i] is not waiter:
        i += 1
    del waiters[i]


def unique(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def tenant_full_message(ticket: Ticket, waiting: int) -> str:
    return (
        f"Tenant `{ticket.tenant}` has {waiting} requests waiting for model `{ticket.model}`, "
        "its share of the queue; retry later."
    )


@dataclass(slots=True)
class _ModelQueue:
    presence: Presence
    clock: FairClock = field(default_factory=FairClock)
    waiters: list[_Waiter] = field(default_factory=list)
    rate: DrainRate = field(default_factory=DrainRate)


class MemoryAdmission:
    """The ``Admission`` contract for one process."""

    def __init__(
        self,
        workers: WorkerView,
        *,
        max_queued: int = 1000,
        max_queued_per_tenant: int | None = None,
        max_wait_s: float = 60.0,
        keepalive_interval_s: float = 5.0,
        reserved_slots: int = 0,
        reserve_window_s: float = 30.0,
        shared_share: float = 1.0,
        replica_id: str = "local",
    ) -> None:
        self._workers = workers
        self._max_queued = max_queued
        self._max_per_tenant = max_queued_per_tenant
        self._max_wait_s = max_wait_s
        self._keepalive_s = keepalive_interval_s
        self._reserved = reserved_slots
        self._window_s = reserve_window_s
        self._share = shared_share
        self.replica_id = replica_id
        self._queues: dict[str, _ModelQueue] = {}
        self._eligible: dict[str, list[_Waiter]] = {}
        self._held: dict[str, int] = {}
        self._held_by: dict[str, dict[str, int]] = {}  # worker -> tenant -> slots
        self._leases: dict[str, tuple[str, str]] = {}  # lease id -> (worker, tenant)
        self._ids = itertools.count(1)

    @classmethod
    def from_config(cls, cfg: QueueConfig, workers: WorkerView, replica_id: str) -> MemoryAdmission:
        return cls(
            workers,
            max_queued=cfg.max_queued,
            max_queued_per_tenant=cfg.max_queued_per_tenant,
            max_wait_s=cfg.max_wait_s,
            keepalive_interval_s=cfg.keepalive_interval_s,
            reserved_slots=cfg.reserved_slots,
            reserve_window_s=cfg.reserve_window_s,
            shared_share=cfg.shared_share,
            replica_id=replica_id,
        )

    def configure(self, cfg: QueueConfig) -> None:
        """A reload's queue settings, at once (no I/O): limits, reserved seats, shared share.
        Waiters a wider limit now admits get their slots here."""
        self._max_queued = cfg.max_queued
        self._max_per_tenant = cfg.max_queued_per_tenant
        self._max_wait_s = cfg.max_wait_s
        self._keepalive_s = cfg.keepalive_interval_s
        self._reserved = cfg.reserved_slots
        self._window_s = cfg.reserve_window_s
        self._share = cfg.shared_share
        for queue in self._queues.values():
            queue.presence.window_s = cfg.reserve_window_s
        for worker in list(self._eligible):
            self._dispatch(worker)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for waiter in self._all_waiters():
            self._unqueue(waiter, granted=False)
            waiter.fut.set_exception(ServiceUnavailable("The gateway is shutting down."))

    def take_now(self, ticket: Ticket) -> Lease | None:
        queue = self._queue(ticket.model)
        queue.presence.saw(ticket.tenant)
        worker = self._free_worker(ticket)
        if worker is None:
            return None
        queue.rate.tick()
        return self._lease(worker, ticket.id, self._take(worker, ticket.tenant), 0.0)

    async def acquire(self, ticket: Ticket, on_wait: WaitCallback | None = None) -> Lease:
        lease = self.take_now(ticket)
        if lease is not None:
            return lease
        candidates = unique(ticket.candidates)
        waiter = self._enqueue(ticket, candidates)
        for name in candidates:
            self._dispatch(name)
        return await self._wait(waiter, on_wait)

    async def release(self, lease: Lease) -> None:
        self.release_now(lease)

    def release_now(self, lease: Lease) -> bool:
        lid = lease.extra.get("lid")
        if isinstance(lid, str):
            self._free(lid)
        return True

    def poke(self, worker: str) -> None:
        self._dispatch(worker)

    async def snapshot(self) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        return {
            "backend": "memory",
            "replica": self.replica_id,
            "models": {name: self._model_view(q, now) for name, q in self._queues.items()},
            "workers": {name: self._worker_view(name, n) for name, n in self._held.items()},
        }

    # -- for the Redis backend's fallback -------------------------------------------------

    def force_hold(self, worker: str, ticket_id: str, tenant: str) -> Lease:
        """Count a slot this process holds already (may exceed capacity until released)."""
        return self._lease(worker, ticket_id, self._take(worker, tenant), 0.0)

    def requeue_all(self) -> int:
        """Fail every waiter with :class:`Requeued`; returns how many."""
        waiters = self._all_waiters()
        for waiter in waiters:
            self._unqueue(waiter, granted=False)
            waiter.fut.set_exception(Requeued())
        return len(waiters)

    # -- slots ----------------------------------------------------------------------------

    def _has_room(self, worker: str) -> bool:
        return self._held.get(worker, 0) < self._workers.slots(worker)

    def _free_worker(self, ticket: Ticket) -> str | None:
        """A candidate with room that ``ticket`` may take and no waiter ahead of it may."""
        held, eligible = self._held, self._eligible
        for name in ticket.candidates:
            slots = self._workers.slots(name)
            n = held.get(name, 0)
            if (
                n < slots
                and self._may_take(name, ticket, slots, n)
                and (name not in eligible or self._first_allowed(name) is None)
            ):
                return name
        return None

    def _may_take(self, worker: str, ticket: Ticket, capacity: int, held: int) -> bool:
        """False only for a tenant at its limit on ``worker`` (of ``capacity`` slots, ``held``
        taken) while another tenant is active, or at its shared limit while another tenant
        runs there (``fairness``)."""
        if self._reserved <= 0:
            return True
        limit = tenant_limit(capacity, self._reserved)
        if held < limit and held <= capacity * self._share:
            return True  # nobody holds either limit's worth beside another tenant
        by = self._held_by.get(worker) or {}
        mine = by.get(ticket.tenant, 0)
        if mine and len(by) > 1 and mine >= shared_limit(capacity, self._share):
            return False  # another tenant runs here: no more prefills into its batch
        if held < limit or mine < limit:
            return True
        queue = self._queue(ticket.model)
        tenant = ticket.tenant
        return not (queue.presence.others(tenant) or queue.clock.others_waiting(tenant))

    def _first_allowed(self, worker: str) -> _Waiter | None:
        """The waiter eligible for ``worker`` that takes its next slot: the first that is still
        first in line for this worker (``Ticket.prefer_s``), else the first that prefers no
        other, else the first at all: a slot never stays empty. Each looked at only if it may
        take the slot (reserved seats)."""
        capacity, held = self._workers.capacity(worker), self._held.get(worker, 0)
        first: _Waiter | None = None
        plain: _Waiter | None = None
        now = -1.0
        for waiter in self._eligible.get(worker, ())[:RESERVE_SCAN]:
            if not self._may_take(worker, waiter.ticket, capacity, held):
                continue
            ticket = waiter.ticket
            if first is None:
                first = waiter
            if not ticket.prefer_s:
                if plain is None:
                    plain = waiter
                continue
            if now < 0:
                now = asyncio.get_running_loop().time()
            if now - waiter.since >= ticket.prefer_s:  # lapsed: plain queue order
                if plain is None:
                    plain = waiter
            elif ticket.candidates[0] == worker:
                return waiter
        return plain or first

    def _take(self, worker: str, tenant: str) -> str:
        lid = f"{self.replica_id}|{next(self._ids)}"
        self._leases[lid] = (worker, tenant)
        self._held[worker] = self._held.get(worker, 0) + 1
        by = self._held_by.setdefault(worker, {})
        by[tenant] = by.get(tenant, 0) + 1
        return lid

    def _free(self, lid: str) -> None:
        held = self._leases.pop(lid, None)
        if held is None:
            return  # released twice: ignore
        worker, tenant = held
        self._held[worker] -= 1
        by = self._held_by[worker]
        by[tenant] -= 1
        if not by[tenant]:
            del by[tenant]
        self._dispatch(worker)

    def _lease(self, worker: str, ticket_id: str, lid: str, queued_s: float) -> Lease:
        extra: dict[str, Any] = {"lid": lid, "replica": self.replica_id}
        return Lease(worker=worker, ticket_id=ticket_id, queued_s=queued_s, extra=extra)

    def _dispatch(self, worker: str) -> None:
        if worker not in self._eligible:
            return  # nobody waits for it (the common case: a release with an empty queue)
        while self._has_room(worker):
            waiter = self._first_allowed(worker)
            if waiter is None:
                return
            self._grant(waiter, worker)

    def _grant(self, waiter: _Waiter, worker: str) -> None:
        self._unqueue(waiter, granted=True)
        waiter.lid = self._take(worker, waiter.ticket.tenant)
        self._queue(waiter.ticket.model).rate.tick()
        waiter.fut.set_result(worker)

    # -- queue ----------------------------------------------------------------------------

    def _queue(self, model: str) -> _ModelQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue(Presence(self._window_s))
        return queue

    def _all_waiters(self) -> list[_Waiter]:
        return [w for q in self._queues.values() for w in q.waiters]

    def _enqueue(self, ticket: Ticket, candidates: tuple[str, ...]) -> _Waiter:
        queue = self._queue(ticket.model)
        self._check_room(ticket, queue)
        loop = asyncio.get_running_loop()
        key = queue.clock.arrive(ticket.priority, ticket.tenant)
        waiter = _Waiter(ticket, key, candidates, loop.create_future(), since=loop.time())
        insort(queue.waiters, waiter, key=_key)
        for name in candidates:
            insort(self._eligible.setdefault(name, []), waiter, key=_key)
        return waiter

    def _check_room(self, ticket: Ticket, queue: _ModelQueue) -> None:
        """Raise ``QueueFull`` when the model's queue, or the tenant's share of it, is full."""
        depth = len(queue.waiters)
        if depth >= self._max_queued:
            wait = retry_after(depth + 1, queue.rate.per_second(), self._max_wait_s)
            raise QueueFull(
                f"The queue for model `{ticket.model}` is full ({depth} waiting); retry later.",
                retry_after_s=wait,
            )
        mine = queue.clock.waiting(ticket.tenant)
        if self._max_per_tenant is not None and mine >= self._max_per_tenant:
            wait = retry_after(depth + 1, queue.rate.per_second(), self._max_wait_s)
            raise QueueFull(tenant_full_message(ticket, mine), retry_after_s=wait)

    def _unqueue(self, waiter: _Waiter, *, granted: bool) -> None:
        queue = self._queues[waiter.ticket.model]
        _remove(queue.waiters, waiter)
        for name in waiter.candidates:
            eligible = self._eligible[name]
            _remove(eligible, waiter)
            if not eligible:
                del self._eligible[name]
        queue.clock.leave(waiter.key, waiter.ticket.tenant, granted=granted)
        waiter.queued = False

    def _position_now(self, waiter: _Waiter) -> int:
        waiters = self._queues[waiter.ticket.model].waiters
        return bisect_left(waiters, waiter.key, key=_key) + 1

    async def _position(self, waiter: _Waiter) -> int:
        return self._position_now(waiter)

    async def _wait(self, waiter: _Waiter, on_wait: WaitCallback | None) -> Lease:
        ticket = waiter.ticket
        deadline = waiter.since + ticket.max_wait_s
        position = partial(self._position, waiter)
        try:
            worker = await wait_for_grant(
                waiter.fut, deadline, self._keepalive_s, position, on_wait
            )
        except BaseException:
            self._abandon(waiter)
            raise
        if worker is None:
            timeout = self._timeout(waiter)
            self._abandon(waiter)
            raise timeout
        assert waiter.lid is not None
        queued_s = asyncio.get_running_loop().time() - waiter.since
        return self._lease(worker, ticket.id, waiter.lid, queued_s)

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiter will not use a slot: leave the queue, or give back a slot it raced to."""
        if waiter.queued:
            self._unqueue(waiter, granted=False)
        elif waiter.lid is not None:
            self._free(waiter.lid)
        consume(waiter.fut)

    def _timeout(self, waiter: _Waiter) -> QueueTimeout:
        ticket = waiter.ticket
        rate = self._queues[ticket.model].rate.per_second()
        return QueueTimeout(
            f"No slot for model `{ticket.model}` within {ticket.max_wait_s:g}s; retry later.",
            retry_after_s=retry_after(self._position_now(waiter), rate, self._max_wait_s),
        )

    # -- snapshot -------------------------------------------------------------------------

    def _model_view(self, queue: _ModelQueue, now: float) -> dict[str, Any]:
        oldest = min((w.since for w in queue.waiters), default=now)
        return {
            "depth": len(queue.waiters),
            "oldest_wait_s": round(now - oldest, 3),
            "tenants": queue.clock.tenants(),
            "drain_rate_per_s": round(queue.rate.per_second(), 3),
        }

    def _worker_view(self, worker: str, held: int) -> dict[str, Any]:
        return {"held": held, "by_replica": {self.replica_id: held} if held else {}}
