"""A reload's queue settings apply at once (``Admission.configure``) on both backends: a
fuller queue is refused by the old limit and admitted by the new one, and a wider tenant
limit hands a waiting request the slot the old one kept back. Nothing is left held."""

from __future__ import annotations

import asyncio

import pytest

from gpupool.gateway.errors import QueueFull

from .conftest import GRANT_S, FakeWorkers, Make, depth, enqueue, held, queue_config, ticket


async def test_a_larger_queue_limit_admits_at_once(make: Make) -> None:
    adm = await make(FakeWorkers(w=1), max_queued=1)
    busy = await adm.acquire(ticket(("w",)))
    first = await enqueue(adm, ticket(("w",)))
    with pytest.raises(QueueFull):
        await adm.acquire(ticket(("w",)))
    adm.configure(queue_config("redis://unused", max_queued=5))
    second = await enqueue(adm, ticket(("w",)))
    assert await depth(adm) == 2
    await adm.release(busy)
    await adm.release(await asyncio.wait_for(first, GRANT_S))
    await adm.release(await asyncio.wait_for(second, GRANT_S))
    assert await held(adm, "w") == 0 and await depth(adm) == 0


async def test_reserved_seats_turned_off_hand_the_kept_slot_to_a_waiter(make: Make) -> None:
    """Another tenant was active: `t` may hold 1 of 2 slots and waits for the second; with
    reserved seats off by reload its waiter takes the free slot."""
    adm = await make(FakeWorkers(w=2), reserved_slots=1)
    await adm.release(await adm.acquire(ticket(("w",), tenant="other")))
    mine = await adm.acquire(ticket(("w",)))
    waiting = await enqueue(adm, ticket(("w",)))
    adm.configure(queue_config("redis://unused", reserved_slots=0))
    lease = await asyncio.wait_for(waiting, GRANT_S)  # memory at once; Redis at its next recheck
    assert lease.worker == "w"
    await adm.release(lease)
    await adm.release(mine)
    assert await held(adm, "w") == 0 and await depth(adm) == 0
