"""Queue arithmetic shared by both admission backends: waiter order and drain rate.

Order among waiters of one model is the tuple ``(priority, start, seq)``:

* ``priority`` first, lower first (vLLM's convention);
* ``start``: a start-time fair queueing (SFQ) tag, so tenants share the queue fairly;
* ``seq``: arrival, a counter that breaks ties.

SFQ with unit cost. Each ``(model, priority)`` has a virtual clock ``V``. A request of tenant
``t`` arriving gets ``start = max(V, F[t])`` and moves the tenant's finish tag ``F[t]`` to
``start + 1``; granting a request moves ``V`` to ``max(V, start)``. So a tenant's n-th waiting
request ranks with every other tenant's n-th one: 500 queued requests of one tenant delay another
tenant's single request by at most one place per tenant, not by 500. ``F[t]`` is forgotten when
the tenant has nothing waiting at that priority, so served or cancelled requests leave no debt.

The Redis backend runs the same rules in Lua (``redis_scripts.py``); there the tuple is encoded as
a fixed-width string (:func:`encode_key`) so a sorted set with equal scores orders members by it.

Drain rate: an exponentially decaying count of grants, ``r <- r * exp(-dt / tau) + 1 / tau`` per
grant; for a steady rate of grants it converges to that rate (grants per second).
``Retry-After`` is then ``position / rate`` clamped to ``[1, max_wait]`` (:func:`retry_after`).

Reserved seats. Fair queueing orders waiters, but a waiter still waits for a slot to free: a
tenant that fills every slot of a worker makes everyone else's next request wait for one of its
requests to end. So while another tenant is *active* (it asked for a slot of the model within
``reserve_window_s``, or it is waiting in the model's queue), one tenant may hold at most
:func:`tenant_limit` slots of a worker (its capacity less ``reserved_slots``, at least 1): the
rest stay free for the others. A tenant alone uses every slot. A freed slot goes to the first
waiter in order that may take it, looking at most :data:`RESERVE_SCAN` waiters deep (so a
backlog costs a bounded walk).

Shared workers. vLLM batches each new request's prefill with the running decodes, so every
request a batch tenant starts on a worker slows each step of the other requests there: on CPU
vLLM, a 16-token interactive request beside three decoding ones took 1.3x its idle time, but
4x when those three were replaced as they finished. So while another tenant has a request
running on a worker, a tenant holding :func:`shared_limit` of its slots (``shared_share`` of
its capacity, at least 1) takes no more there; what it holds is never taken back, and once the
other's request ends it fills the worker again. Part of reserved seats: off with them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

OrderKey = tuple[int, int, int]  # (priority, start tag, arrival seq)

PRIORITY_LIMIT = 10**9 - 1  # priorities are clamped to +-this (10 decimal digits when encoded)
RATE_TAU_S = 10.0  # memory of the drain-rate estimate
RESERVE_SCAN = 64  # waiters a dispatch looks at for one that may take a reserved seat


def clamp_priority(priority: int) -> int:
    return max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, priority))


def encode_key(key: OrderKey, ident: str) -> str:
    """The Redis sorted-set member for a waiter: lexicographic order equals ``key`` order."""
    priority, start, seq = key
    return f"{priority + PRIORITY_LIMIT + 1:010d}:{start:016d}:{seq:016d}:{ident}"


def retry_after(position: int, rate_per_s: float, max_wait_s: float) -> float:
    """Seconds until ``position`` is likely served at ``rate_per_s``, clamped to [1, max_wait]."""
    if rate_per_s <= 0.0:
        return max_wait_s
    return min(max_wait_s, max(1.0, position / rate_per_s))


def tenant_limit(capacity: int, reserved: int) -> int:
    """The most slots of a worker one tenant may hold while another tenant is active."""
    return capacity - max(0, min(reserved, capacity - 1))


def shared_limit(capacity: int, share: float) -> int:
    """The slots of a worker past which a tenant takes no more while another tenant runs there."""
    return max(1, int(capacity * share))


@dataclass(slots=True)
class _Flow:
    finish: int
    waiting: int = 0


class FairClock:
    """SFQ tags for one model (all its priorities)."""

    def __init__(self) -> None:
        self._vtime: dict[int, int] = {}
        self._flows: dict[tuple[int, str], _Flow] = {}
        self._waiting: dict[str, int] = {}  # per tenant, all priorities
        self._seq = itertools.count(1)

    def arrive(self, priority: int, tenant: str) -> OrderKey:
        priority = clamp_priority(priority)
        vtime = self._vtime.get(priority, 0)
        flow = self._flows.setdefault((priority, tenant), _Flow(finish=vtime))
        start = max(vtime, flow.finish)
        flow.finish = start + 1
        flow.waiting += 1
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1
        return (priority, start, next(self._seq))

    def leave(self, key: OrderKey, tenant: str, *, granted: bool) -> None:
        """A waiter left the queue: granted (advances the clock) or withdrawn."""
        priority, start, _ = key
        if granted and start > self._vtime.get(priority, 0):
            self._vtime[priority] = start
        flow = self._flows.get((priority, tenant))
        if flow is None:
            return
        flow.waiting -= 1
        if flow.waiting <= 0:
            del self._flows[(priority, tenant)]
        left = self._waiting[tenant] - 1
        if left:
            self._waiting[tenant] = left
        else:
            del self._waiting[tenant]

    def waiting(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting (all priorities)."""
        return self._waiting.get(tenant, 0)

    def tenants(self) -> dict[str, int]:
        """Waiting requests per tenant (all priorities)."""
        return dict(self._waiting)

    def others_waiting(self, tenant: str) -> bool:
        """Whether a tenant other than ``tenant`` has a request waiting."""
        return len(self._waiting) > (tenant in self._waiting)


class Presence:
    """When each tenant last asked for a slot of one model, forgotten after ``window_s``."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window_s
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # oldest first

    @property
    def window_s(self) -> float:
        return self._window

    @window_s.setter
    def window_s(self, value: float) -> None:
        self._window = value

    def saw(self, tenant: str) -> None:
        now = self._clock()
        seen = self._seen
        seen[tenant] = now
        seen.move_to_end(tenant)
        if len(seen) > 1:  # alone, the tenant just seen is the one to keep
            self._forget(now)

    def others(self, tenant: str) -> bool:
        """Whether a tenant other than ``tenant`` asked within the window."""
        self._forget(self._clock())
        return len(self._seen) > (tenant in self._seen)

    def _forget(self, now: float) -> None:
        horizon = now - self._window
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if at >= horizon:
                return
            del self._seen[oldest]


class DrainRate:
    """Grants per second, an exponentially decaying event count (see module docstring)."""

    def __init__(
        self, tau_s: float = RATE_TAU_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._tau = tau_s
        self._clock = clock
        self._rate = 0.0
        self._at = clock()

    def per_second(self) -> float:
        return self._rate * math.exp(-(self._clock() - self._at) / self._tau)

    def tick(self) -> None:
        now = self._clock()
        self._rate = self._rate * math.exp((self._at - now) / self._tau) + 1.0 / self._tau
        self._at = now
