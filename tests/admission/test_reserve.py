"""Reserved seats (``queue.reserved_slots``), against both backends (``make`` is parametrized).

While another tenant is active, one tenant may not fill a worker: its last ``reserved_slots``
slots wait for the others, so their next request starts at once instead of behind a batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from gpupool.gateway.admission.base import Admission, Lease
from gpupool.gateway.admission.redis_backend import RedisAdmission

from .conftest import GRANT_S, FakeWorkers, Make, enqueue, held, ticket


async def _fill(adm: Admission, tenant: str, n: int, worker: str = "w1") -> list[Lease]:
    leases = [await adm.acquire(ticket((worker,), tenant=tenant)) for _ in range(n)]
    assert [lease.queued_s for lease in leases] == [0.0] * n
    return leases


async def test_a_tenant_alone_uses_every_slot(make: Make) -> None:
    adm = await make(FakeWorkers(w1=4), reserved_slots=1)
    leases = await _fill(adm, "batch", 4)
    assert await held(adm, "w1") == 4
    for lease in leases:
        await adm.release(lease)


async def test_a_batch_leaves_a_seat_while_another_tenant_is_active(make: Make) -> None:
    adm = await make(FakeWorkers(w1=4), reserved_slots=1)
    await adm.release(await adm.acquire(ticket(tenant="chat")))  # chat was here a moment ago
    batch = await _fill(adm, "batch", 3)
    backlog = [await enqueue(adm, ticket(tenant="batch")) for _ in range(5)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in backlog) and await held(adm, "w1") == 3
    chat = await adm.acquire(ticket(tenant="chat"))  # ahead of the backlog, without waiting
    assert (chat.worker, chat.queued_s) == ("w1", 0.0)
    await adm.release(chat)  # the seat stays free for chat: batch is at its limit
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in backlog) and await held(adm, "w1") == 3
    await adm.release(batch[0])  # batch's own slot goes back to batch
    first = await asyncio.wait_for(backlog[0], GRANT_S)
    assert await held(adm, "w1") == 3
    for task in backlog[1:]:
        task.cancel()
    await asyncio.gather(*backlog[1:], return_exceptions=True)
    for lease in [first, *batch[1:]]:
        await adm.release(lease)


async def test_two_busy_tenants_still_fill_the_worker(make: Make) -> None:
    adm = await make(FakeWorkers(w1=4), reserved_slots=1)
    a = await _fill(adm, "a", 2)
    b = await _fill(adm, "b", 2)  # nobody is over the limit (3): all four slots in use
    waiting = [await enqueue(adm, ticket(tenant=t)) for t in ("a", "b")]
    await adm.release(a[0])  # a holds 1: its waiter (first in order) takes the slot
    got = await asyncio.wait_for(waiting[0], GRANT_S)
    assert got.worker == "w1" and await held(adm, "w1") == 4
    waiting[1].cancel()
    await asyncio.gather(waiting[1], return_exceptions=True)
    for lease in [got, a[1], *b]:
        await adm.release(lease)


async def test_the_seat_is_given_back_when_the_others_go_quiet(make: Make) -> None:
    # 1.5 s, not 0.3: the check below must come inside the window, after three acquires and two
    # queued through Redis (at 0.3 s a 0.25-s stall there gave batch the seat: a false failure)
    window_s = 1.5
    adm = await make(FakeWorkers(w1=4), reserved_slots=1, reserve_window_s=window_s)
    await adm.release(await adm.acquire(ticket(tenant="chat")))
    chat_seen = time.monotonic()
    batch = await _fill(adm, "batch", 3)
    backlog = [await enqueue(adm, ticket(tenant="batch")) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in backlog)
    # chat's window is over: batch may fill the worker again
    await asyncio.sleep(chat_seen + window_s + 0.1 - time.monotonic())
    await adm.release(batch[0])
    leases = await asyncio.wait_for(asyncio.gather(*backlog), GRANT_S)
    assert await held(adm, "w1") == 4
    for lease in [*leases, *batch[1:]]:
        await adm.release(lease)


async def test_a_tenant_waiting_elsewhere_counts_as_active_past_the_window(make: Make) -> None:
    adm = await make(FakeWorkers(w1=4, w2=1), reserved_slots=1, reserve_window_s=0.2)
    on_w2 = await adm.acquire(ticket(("w2",), tenant="chat"))
    chat_waits = await enqueue(adm, ticket(("w2",), tenant="chat"))
    await asyncio.sleep(0.3)
    batch = await _fill(adm, "batch", 3)
    fourth = await enqueue(adm, ticket(tenant="batch"))
    await asyncio.sleep(0.05)
    assert not fourth.done()  # chat still waits (for w2): the seat on w1 stays
    await adm.release(on_w2)
    chat = await asyncio.wait_for(chat_waits, GRANT_S)
    await adm.release(chat)
    await asyncio.sleep(0.3)  # now chat is neither waiting nor recent
    await adm.release(batch[0])
    await asyncio.wait_for(fourth, GRANT_S)
    for lease in [fourth.result(), *batch[1:]]:
        await adm.release(lease)


async def _shared_worker(
    make: Make, **kw: float
) -> tuple[Admission, list[Lease], Lease, list[asyncio.Task[Lease]]]:
    """w1 (4 slots): batch holds 3 and has 5 more waiting; chat runs in the reserved seat."""
    adm = await make(FakeWorkers(w1=4), reserved_slots=1, **kw)
    await adm.release(await adm.acquire(ticket(tenant="chat")))
    batch = await _fill(adm, "batch", 3)
    backlog = [await enqueue(adm, ticket(tenant="batch")) for _ in range(5)]
    chat = await adm.acquire(ticket(tenant="chat"))
    assert (chat.worker, chat.queued_s) == ("w1", 0.0)
    return adm, batch, chat, backlog


async def _drop(adm: Admission, leases: list[Lease], tasks: list[asyncio.Task[Lease]]) -> None:
    for task in tasks:
        task.cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for lease in [*leases, *(d for d in done if isinstance(d, Lease))]:
        await adm.release(lease)
    assert await held(adm, "w1") == 0


async def test_a_batch_does_not_refill_a_worker_while_another_tenant_runs_there(
    make: Make,
) -> None:
    """Each request batch starts would prefill into chat's decode steps: while chat runs on w1,
    batch (at half of w1's slots) takes no more there; once chat is done it fills w1 again, up
    to its reserved-seat limit."""
    adm, batch, chat, backlog = await _shared_worker(make)
    await adm.release(batch[0])  # batch holds 2 of 4 beside chat: no refill
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in backlog) and await held(adm, "w1") == 3
    await adm.release(chat)  # chat is gone: batch takes one slot back, the seat stays free
    first = await asyncio.wait_for(backlog[0], GRANT_S)
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in backlog[1:]) and await held(adm, "w1") == 3
    await _drop(adm, [*batch[1:], first], backlog[1:])


async def test_a_batch_refills_beside_another_tenant_with_the_shared_limit_off(
    make: Make,
) -> None:
    adm, batch, chat, backlog = await _shared_worker(make, shared_share=1.0)
    await adm.release(batch[0])  # batch holds 2 of 4: its waiter takes the slot at once
    first = await asyncio.wait_for(backlog[0], GRANT_S)
    assert await held(adm, "w1") == 4
    await _drop(adm, [*batch[1:], first, chat], backlog[1:])


async def test_no_reserve_when_off(make: Make) -> None:
    adm = await make(FakeWorkers(w1=4), reserved_slots=0)
    await adm.release(await adm.acquire(ticket(tenant="chat")))
    for lease in await _fill(adm, "batch", 4):
        await adm.release(lease)


async def test_a_worker_keeps_one_slot_per_tenant(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), reserved_slots=3)
    await adm.release(await adm.acquire(ticket(tenant="chat")))
    for lease in await _fill(adm, "batch", 1):  # capacity 1 reserves nothing
        await adm.release(lease)


async def test_the_limit_is_per_worker_and_the_batch_spills_to_the_next(make: Make) -> None:
    adm = await make(FakeWorkers(w1=2, w2=2), reserved_slots=1)
    await adm.release(await adm.acquire(ticket(("w1", "w2"), tenant="chat")))
    got = [await adm.acquire(ticket(("w1", "w2"), tenant="batch")) for _ in range(2)]
    assert [g.worker for g in got] == ["w1", "w2"]  # one of each: a seat left on both
    third = await enqueue(adm, ticket(("w1", "w2"), tenant="batch"))
    chat = await adm.acquire(ticket(("w2", "w1"), tenant="chat"))
    assert (chat.worker, chat.queued_s) == ("w2", 0.0)
    third.cancel()
    await asyncio.gather(third, return_exceptions=True)
    for lease in [*got, chat]:
        await adm.release(lease)


async def test_replicas_keep_the_seat_for_a_tenant_seen_by_another(
    make_redis: Callable[..., Awaitable[RedisAdmission]],
) -> None:
    workers = FakeWorkers(w1=4)
    chat_side = await make_redis(workers, reserved_slots=1)
    batch_side = await make_redis(workers, reserved_slots=1)
    await chat_side.release(await chat_side.acquire(ticket(tenant="chat")))
    batch = await _fill(batch_side, "batch", 3)
    fourth = await enqueue(batch_side, ticket(tenant="batch"))
    chat = await chat_side.acquire(ticket(tenant="chat"))
    assert chat.queued_s == 0.0 and not fourth.done()
    await chat_side.release(chat)
    await asyncio.sleep(0.1)
    assert not fourth.done() and await held(batch_side, "w1") == 3
    fourth.cancel()
    await asyncio.gather(fourth, return_exceptions=True)
    for lease in batch:
        await batch_side.release(lease)
