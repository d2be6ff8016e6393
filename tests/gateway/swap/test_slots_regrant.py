"""A slot granted on a worker that starts falling asleep before the request is counted on it is
given back and the request queues again (pipeline/slots.py): a swap group calls /sleep once a
worker's started requests are 0, so a grant not yet counted must never be sent there."""

from __future__ import annotations

import asyncio

from gpupool.gateway.admission.base import Lease, Ticket, WaitCallback
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.slots import Slots
from gpupool.workers.registry import Registry, Worker, WorkerState


class _Admission:
    """Grants ``grants`` in turn; before the first grant is seen by its waiter, ``between``
    runs (the event-loop turn in which a swap group can act)."""

    def __init__(self, grants: list[str], between: object) -> None:
        self.grants = grants
        self.between = between
        self.released: list[str] = []

    async def acquire(self, ticket: Ticket, on_wait: WaitCallback | None = None) -> Lease:
        worker = self.grants.pop(0)
        if callable(self.between):
            self.between()
            self.between = None
        return Lease(worker, ticket.id)

    async def release(self, lease: Lease) -> None:
        self.released.append(lease.worker)


async def test_a_grant_on_a_worker_falling_asleep_is_given_back_and_queued_again() -> None:
    registry = Registry()
    a, b = Worker("a", "m", state=WorkerState.ready), Worker("b", "m", state=WorkerState.ready)
    registry.add(a)
    registry.add(b)

    def group_acts() -> None:  # the swap group: nothing started on `a`, so it falls asleep
        assert a.inflight == 0
        registry.transition(a, WorkerState.falling_asleep)

    admission = _Admission(["a", "b"], group_acts)
    slots = Slots(admission, registry, Metrics())  # type: ignore[arg-type]
    ticket = Ticket("t1", "m", "tenant", 0, ["a", "b"], max_wait_s=5.0)
    lease = await asyncio.wait_for(slots.take(ticket), 5.0)
    assert lease.worker == "b"
    assert admission.released == ["a"]
    assert (a.inflight, b.inflight) == (0, 1)
    await slots.give(lease)
    assert b.inflight == 0


async def test_a_grant_on_a_ready_worker_is_kept() -> None:
    registry = Registry()
    a = Worker("a", "m", state=WorkerState.ready)
    registry.add(a)
    admission = _Admission(["a"], None)
    slots = Slots(admission, registry, Metrics())  # type: ignore[arg-type]
    lease = await slots.take(Ticket("t1", "m", "tenant", 0, ["a"], max_wait_s=5.0))
    assert lease.worker == "a" and a.inflight == 1 and admission.released == []
    await slots.give(lease)
