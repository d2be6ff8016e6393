"""A queued conversation's preference for its own worker (``Ticket.prefer_s``) never leaves a
slot empty: admission is work-conserving on both backends (``make`` is parametrized); the
memory backend also gives the preferred worker's freed slot to the waiter that prefers it
first. Nothing is left held."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gpupool.gateway.admission.base import Admission
from gpupool.gateway.admission.memory import MemoryAdmission

from .conftest import GRANT_S, FakeWorkers, Make, depth, enqueue, held, ticket

# A preference that does not lapse while a test waits for a grant (GRANT_S): a grant within
# GRANT_S shows the waiter did not wait for its preferred worker
PREFER_S = 3 * GRANT_S


async def _all_back(adm: Admission) -> None:
    assert await held(adm, "home") == 0 and await held(adm, "other") == 0
    assert await depth(adm) == 0


async def test_a_free_slot_elsewhere_is_taken_at_once(make: Make) -> None:
    """The lane's skew: waiting for a full `home` while `other` had room left it empty."""
    adm = await make(FakeWorkers(home=1, other=1))
    busy = await adm.acquire(ticket(("home",)))
    lease = await asyncio.wait_for(
        adm.acquire(replace(ticket(("home", "other")), prefer_s=PREFER_S)), GRANT_S
    )
    assert lease.worker == "other"
    await adm.release(lease)
    await adm.release(busy)
    await _all_back(adm)


async def test_a_lone_waiter_takes_whichever_slot_frees_first(make: Make) -> None:
    adm = await make(FakeWorkers(home=1, other=1))
    busy = {w: await adm.acquire(ticket((w,))) for w in ("home", "other")}
    task = await enqueue(adm, replace(ticket(("home", "other")), prefer_s=PREFER_S))
    await adm.release(busy["other"])  # nobody else waits: the slot must not stay empty
    lease = await asyncio.wait_for(task, GRANT_S)
    assert lease.worker == "other"
    await adm.release(lease)
    await adm.release(busy["home"])
    await _all_back(adm)


async def test_each_freed_slot_goes_to_the_waiter_that_prefers_it(make: Make) -> None:
    """Two conversations queued, `first` at home's, `second` plain. `other` frees: memory
    passes `first` over for it (it prefers home) and gives it to `second`; home frees next
    and `first` gets it. Redis keeps plain queue order (`first` takes `other`): both
    work-conserving, every slot back."""
    adm = await make(FakeWorkers(home=1, other=1))
    busy = {w: await adm.acquire(ticket((w,))) for w in ("home", "other")}
    first = await enqueue(adm, replace(ticket(("home", "other")), prefer_s=PREFER_S))
    second = await enqueue(adm, ticket(("other", "home")))
    await adm.release(busy["other"])
    done, _ = await asyncio.wait(
        {first, second}, timeout=GRANT_S, return_when=asyncio.FIRST_COMPLETED
    )
    (got,) = done
    assert got.result().worker == "other"
    assert got is (second if isinstance(adm, MemoryAdmission) else first)
    await adm.release(busy["home"])
    rest = second if got is first else first
    lease = await asyncio.wait_for(rest, GRANT_S)
    assert lease.worker == "home"
    for t in (first, second):
        await adm.release(t.result())
    await _all_back(adm)


async def test_a_preference_lapses_into_plain_queue_order(make: Make) -> None:
    adm = await make(FakeWorkers(home=1, other=1))
    busy = {w: await adm.acquire(ticket((w,))) for w in ("home", "other")}
    first = await enqueue(adm, replace(ticket(("home", "other")), prefer_s=0.05))
    second = await enqueue(adm, ticket(("other", "home")))
    await asyncio.sleep(0.1)
    await adm.release(busy["other"])
    lease = await asyncio.wait_for(first, GRANT_S)  # its preference lapsed: first in line again
    assert lease.worker == "other"
    await adm.release(busy["home"])
    await adm.release(await asyncio.wait_for(second, GRANT_S))
    await adm.release(lease)
    await _all_back(adm)


async def test_a_cancelled_waiter_leaves_nothing(make: Make) -> None:
    adm = await make(FakeWorkers(home=1, other=1))
    busy = [await adm.acquire(ticket((w,), tenant="x")) for w in ("home", "other")]
    task = await enqueue(adm, replace(ticket(("home", "other")), prefer_s=PREFER_S))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for lease in busy:
        await adm.release(lease)
    await _all_back(adm)


async def test_the_waiter_that_prefers_a_worker_passes_plain_ones_there(make: Make) -> None:
    """Memory: `home` frees; a plain waiter queued earlier gets `other`'s next slot instead
    (Redis: queue order). Both work-conserving."""
    adm = await make(FakeWorkers(home=1, other=1))
    busy = {w: await adm.acquire(ticket((w,))) for w in ("home", "other")}
    plain = await enqueue(adm, ticket(("other", "home")))
    homed = await enqueue(adm, replace(ticket(("home", "other")), prefer_s=PREFER_S))
    await adm.release(busy["home"])
    done, _ = await asyncio.wait(
        {plain, homed}, timeout=GRANT_S, return_when=asyncio.FIRST_COMPLETED
    )
    (got,) = done
    assert got.result().worker == "home"
    assert got is (homed if isinstance(adm, MemoryAdmission) else plain)
    await adm.release(busy["other"])
    rest = plain if got is homed else homed
    await adm.release(await asyncio.wait_for(rest, GRANT_S))
    await adm.release(got.result())
    await _all_back(adm)
