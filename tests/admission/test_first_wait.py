"""A conversation's full worker: ``Slots.take`` waits ``first_wait_s`` for its first candidate
alone, then takes any, on both backends (``make`` is parametrized). Nothing is left held."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from gpupool.gateway.admission.base import Admission, Lease
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.slots import Slots
from gpupool.workers.registry import Registry, Worker, WorkerState

from .conftest import FakeWorkers, Make, depth, held, ticket


def slots_over(adm: Admission) -> Slots:
    registry = Registry()
    for name in ("home", "other"):
        registry.add(Worker(name, "m", url=f"http://{name}", state=WorkerState.ready, capacity=1))
    return Slots(adm, registry, Metrics())


async def _waits_for_home(adm: Admission, slots: Slots, holder: Lease) -> None:
    """A ticket that prefers `home` (held by ``holder``) takes nothing at once, waits, and
    gets `home` once ``holder`` is released; every slot is back afterwards."""
    t = replace(ticket(("home", "other")), first_wait_s=5.0)
    assert slots.take_now(t) is None and t.candidates == ["home", "other"]
    task = asyncio.create_task(slots.take(t))
    await asyncio.sleep(0.2)
    assert not task.done()
    await adm.release(holder)
    lease = await asyncio.wait_for(task, 2)
    assert lease.worker == "home"
    await slots.give(lease)
    assert await held(adm, "home") == 0 and await held(adm, "other") == 0


async def test_a_slot_freed_at_home_within_the_wait_is_taken_there(make: Make) -> None:
    adm = await make(FakeWorkers(home=1, other=1))
    slots = slots_over(adm)
    busy = await adm.acquire(ticket(("home",)))
    await _waits_for_home(adm, slots, busy)  # `other` is free, but home is worth the wait


async def test_after_the_wait_any_candidate_serves(make: Make) -> None:
    adm = await make(FakeWorkers(home=1, other=1))
    slots = slots_over(adm)
    busy = await adm.acquire(ticket(("home",)))
    t0 = time.monotonic()
    lease = await slots.take(replace(ticket(("home", "other")), first_wait_s=0.3))
    assert lease.worker == "other" and time.monotonic() - t0 >= 0.3
    assert lease.queued_s >= 0.3
    await slots.give(lease)
    await adm.release(busy)
    assert await held(adm, "home") == 0 and await held(adm, "other") == 0


async def test_a_cancel_during_either_wait_leaves_nothing(make: Make) -> None:
    adm = await make(FakeWorkers(home=1, other=1))
    slots = slots_over(adm)
    busy = [await adm.acquire(ticket((w,), tenant="x")) for w in ("home", "other")]
    for delay in (0.1, 0.5):  # in the wait for home; in the wait for any, after it
        t = replace(ticket(("home", "other")), first_wait_s=0.3)
        task = asyncio.create_task(slots.take(t))
        await asyncio.sleep(delay)
        assert await depth(adm) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await depth(adm) == 0
    for lease in busy:
        await adm.release(lease)
    assert await held(adm, "home") == 0 and await held(adm, "other") == 0


async def test_home_at_the_tenants_reserved_seat_limit_is_waited_for_too(make: Make) -> None:
    """Another tenant was active: `t` may hold 1 of home's 2 slots. Its next request waits
    for home rather than re-reading its history on `other`."""
    adm = await make(FakeWorkers(home=2, other=2), reserved_slots=1)
    slots = slots_over(adm)
    await adm.release(await adm.acquire(ticket(("other",), tenant="chat")))
    mine = await adm.acquire(ticket(("home",)))
    await _waits_for_home(adm, slots, mine)
