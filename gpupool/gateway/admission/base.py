"""Admission: a slot on a worker, or a fair place in a bounded queue.

The request path calls ``acquire`` with a :class:`Ticket` naming the workers that could serve it
(in routing's order of preference) and gets a :class:`Lease` on one of them, and calls ``release``
in ``finally``. Two backends share this contract: ``memory`` (one process) and ``redis`` (several
gateway replicas). No HTTP here.

Order among waiters: ``priority`` first (lower value first, as vLLM's priority scheduling),
then fairness between tenants (each tenant's n-th waiting request ranks with every other
tenant's n-th), then arrival.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpupool.config.models import QueueConfig


# The queue settings a reload applies at once (``Admission.configure``); the rest (backend,
# Redis connection, lease TTL) need a restart.
LIVE_QUEUE = (
    "max_queued",
    "max_queued_per_tenant",
    "max_wait_s",
    "keepalive_interval_s",
    "reserved_slots",
    "reserve_window_s",
    "shared_share",
)


@dataclass(slots=True)
class Ticket:
    id: str
    model: str
    tenant: str
    priority: int
    candidates: list[str]  # eligible worker names, best first
    max_wait_s: float
    stream: bool = False
    # While queued, up to this long: candidates[0]'s freed slot goes to this ticket before
    # waiters that do not prefer it; any candidate's slot may still go to it (work-conserving).
    prefer_s: float = 0.0


@dataclass(slots=True)
class Lease:
    worker: str
    ticket_id: str
    queued_s: float = 0.0  # time spent waiting (0 when a slot was free)
    extra: dict[str, Any] = field(default_factory=dict)  # backend bookkeeping


class WorkerView(Protocol):
    """What admission needs to know about workers (the registry provides it)."""

    def capacity(self, worker: str) -> int: ...

    def available(self, worker: str) -> bool:
        """Ready and routable right now."""
        ...

    def slots(self, worker: str) -> int:
        """Its capacity while available, else 0 (one look-up on the hot path)."""
        ...


# Called while a ticket waits, about every ``keepalive_interval_s``, with its 1-based position.
WaitCallback = Callable[[int], Awaitable[None]]


class Admission(Protocol):
    async def start(self) -> None: ...

    def configure(self, cfg: QueueConfig) -> None:
        """A reload's queue settings (limits, waits, reserved seats), applied at once."""
        ...

    async def close(self) -> None: ...

    async def acquire(self, ticket: Ticket, on_wait: WaitCallback | None = None) -> Lease:
        """A lease on one of ``ticket.candidates``.

        Raises ``QueueFull`` at once when the model's queue is full, ``QueueTimeout`` after
        ``ticket.max_wait_s``; both carry a ``retry_after_s`` from the observed drain rate.
        Cancelling the awaiting task removes the ticket from the queue (never executed).
        """
        ...

    def take_now(self, ticket: Ticket) -> Lease | None:
        """A lease at once, without I/O, when a candidate has a free slot and no waiter is
        ahead of ``ticket``; None otherwise (then ``acquire``). Backends that cannot know
        without I/O always return None."""
        ...

    async def release(self, lease: Lease) -> None:
        """Give the slot back; the best eligible waiter for that worker gets it."""
        ...

    def release_now(self, lease: Lease) -> bool:
        """``release`` without I/O where the backend can (True); False: call ``release``."""
        ...

    def poke(self, worker: str) -> None:
        """A worker became available or its capacity changed: hand free slots to waiters."""
        ...

    async def snapshot(self) -> dict[str, Any]:
        """For GET /admin/queue: depth per model, oldest wait, per-tenant counts, slots held."""
        ...
