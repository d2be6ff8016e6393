"""Worker slots: admission's leases, counted on the registry's workers.

``take`` waits for a slot (or raises the queue's 429/503) and counts the request as started on its
worker (a ticket's ``prefer_s`` is admission's business: first in line for its first candidate,
never a slot left empty); ``give``
returns the slot and counts it finished, exactly once per lease however often it is called.
Admission backends remove a cancelled waiter themselves (and give back a slot granted in the same
instant), so a cancellation during ``take`` leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import nullcontext
from dataclasses import replace
from typing import Protocol

from gpupool.gateway.admission.base import Admission, Lease, Ticket, WaitCallback
from gpupool.gateway.errors import RateLimited, UpstreamUnavailable
from gpupool.gateway.metrics import Metrics
from gpupool.workers.registry import SLEEP_STATES, Registry
from gpupool.workers.swap.demand import Demand


class SwapView(Protocol):
    """What the swap groups tell admission of a sleeping model (``SwapController``)."""

    def waiting_note(self, model: str) -> str | None: ...
    def expected_wait(self, model: str) -> float | None: ...


_GIVEN = "given"
_PRIORITY = "priority"  # the ticket's, recorded with ``demand.started`` (swap groups)
_REGRANT_PAUSE_S = 0.05


class Slots:
    def __init__(self, admission: Admission, registry: Registry, metrics: Metrics) -> None:
        self.admission = admission
        self.registry = registry
        self.metrics = metrics
        # Swap groups read which models have requests waiting (workers/swap/demand.py), and
        # say of a model asleep what its requests wait for and how long (``SwapController``).
        self.demand: Demand | None = None
        self.swap: SwapView | None = None

    def swap_note(self, model: str) -> str | None:
        """What a request for ``model`` waits for while it sleeps (None: it does not)."""
        return self.swap.waiting_note(model) if self.swap is not None else None

    def take_now(self, ticket: Ticket) -> Lease | None:
        """A slot at once where admission can grant one without I/O or waiting; None: ``take``."""
        if not ticket.candidates:
            return None
        lease = self.admission.take_now(ticket)
        if lease is not None:
            self._started(ticket, lease)
        return lease

    async def take(self, ticket: Ticket, on_wait: WaitCallback | None = None) -> Lease:
        if not ticket.candidates:
            raise UpstreamUnavailable(f"No worker for model `{ticket.model}` is available.")
        waiting = (
            self.demand.waiting(ticket.model, ticket.priority) if self.demand else nullcontext()
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ticket.max_wait_s
        try:
            with waiting:
                while True:
                    lease = await self.admission.acquire(ticket, on_wait)
                    if not self._falling_asleep(lease):
                        break
                    await self.admission.release(lease)
                    await asyncio.sleep(_REGRANT_PAUSE_S)  # until admission sees the new state
                    ticket = replace(ticket, max_wait_s=max(0.0, deadline - loop.time()))
        except RateLimited as e:
            self.metrics.admission.labels(ticket.model, "rejected", type(e).__name__).inc()
            wait = self.swap.expected_wait(ticket.model) if self.swap is not None else None
            if wait is not None:  # its model sleeps: retry once a switch may have woken it
                e.retry_after_s = wait
                e.headers["retry-after"] = str(max(1, math.ceil(wait)))
            raise
        # No await between the grant and this point: the caller owns the lease from here.
        self._started(ticket, lease)
        return lease

    def _falling_asleep(self, lease: Lease) -> bool:
        """Whether the granted worker left ``ready`` for sleep between its grant and now: a swap
        group puts a worker to sleep once its started requests are 0 (``registry.started`` has
        not counted this one yet: a Redis grant, or a wake-up of the waiting task, takes an
        event-loop turn), so the request must not go there; it queues again."""
        w = self.registry.get(lease.worker)
        return w is not None and w.state in SLEEP_STATES

    def _started(self, ticket: Ticket, lease: Lease) -> None:
        self.registry.started(lease.worker)
        if self.demand is not None:
            self.demand.started(lease.worker, ticket.priority)
            lease.extra[_PRIORITY] = ticket.priority
        self.metrics.admitted(ticket.model).record(lease.queued_s)

    def give_now(self, lease: Lease) -> bool:
        """Give the slot back if that needs no I/O (True, also when given already); False:
        ``give``."""
        if lease.extra.get(_GIVEN):
            return True
        if not self.admission.release_now(lease):
            return False
        lease.extra[_GIVEN] = True
        self.registry.finished(lease.worker)
        if self.demand is not None and _PRIORITY in lease.extra:
            self.demand.finished(lease.worker, lease.extra[_PRIORITY])
        return True

    async def give(self, lease: Lease) -> None:
        if lease.extra.get(_GIVEN):
            return
        lease.extra[_GIVEN] = True
        self.registry.finished(lease.worker)
        if self.demand is not None and _PRIORITY in lease.extra:
            self.demand.finished(lease.worker, lease.extra[_PRIORITY])
        await self.admission.release(lease)
