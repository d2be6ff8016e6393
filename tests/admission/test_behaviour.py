"""The admission contract, run against both backends (``make`` is parametrized)."""

from __future__ import annotations

import asyncio

import pytest

from gpupool.gateway.admission.base import Admission, Lease
from gpupool.gateway.errors import QueueFull, QueueTimeout

from .conftest import GRANT_S, FakeWorkers, Make, depth, enqueue, held, ticket, until


async def _chain(adm: Admission, tasks: dict[str, asyncio.Task[Lease]], first: Lease) -> list[str]:
    """Release ``first``; each waiter, once granted, records itself and releases in turn."""
    order: list[str] = []

    async def relay(name: str, task: asyncio.Task[Lease]) -> None:
        lease = await task
        order.append(name)
        await adm.release(lease)

    relays = [asyncio.create_task(relay(n, t)) for n, t in tasks.items()]
    await adm.release(first)
    await asyncio.wait_for(asyncio.gather(*relays), GRANT_S * len(relays))
    return order


async def test_free_slot_is_immediate_and_capacity_is_a_hard_cap(make: Make) -> None:
    adm = await make(FakeWorkers(w1=2))
    a = await adm.acquire(ticket())
    b = await adm.acquire(ticket())
    assert (a.worker, b.worker, a.queued_s) == ("w1", "w1", 0.0)
    third = await enqueue(adm, ticket())
    await asyncio.sleep(0.05)
    assert not third.done()
    assert await held(adm, "w1") == 2
    await adm.release(a)
    c = await asyncio.wait_for(third, GRANT_S)
    assert c.worker == "w1" and c.queued_s > 0
    await adm.release(b)
    await adm.release(c)
    assert await held(adm, "w1") == 0


async def test_candidates_in_order_of_preference(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1, w2=1))
    first = await adm.acquire(ticket(("w2", "w1")))
    second = await adm.acquire(ticket(("w2", "w1")))
    assert (first.worker, second.worker) == ("w2", "w1")


async def test_queue_full_is_immediate_with_retry_after(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), max_queued=2, max_wait_s=30.0)
    await adm.acquire(ticket())
    waiters = [await enqueue(adm, ticket()) for _ in range(2)]
    with pytest.raises(QueueFull) as err:
        await adm.acquire(ticket())
    assert err.value.status == 429
    # nothing has drained yet: the estimate is the longest wait
    assert err.value.retry_after_s == 30.0
    assert err.value.headers["retry-after"] == "30"
    for w in waiters:
        w.cancel()


async def test_one_tenant_cannot_fill_a_models_queue(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), max_queued=4, max_queued_per_tenant=2, max_wait_s=30.0)
    holder = await adm.acquire(ticket(tenant="batch"))
    batch = [await enqueue(adm, ticket(tenant="batch")) for _ in range(2)]
    with pytest.raises(QueueFull) as err:
        await adm.acquire(ticket(tenant="batch"))
    assert err.value.status == 429 and "retry-after" in err.value.headers
    assert "`batch`" in err.value.message and "share" in err.value.message
    others = [await enqueue(adm, ticket(tenant="chat")) for _ in range(2)]  # room for others
    assert (await adm.snapshot())["models"]["m"]["tenants"] == {"batch": 2, "chat": 2}
    with pytest.raises(QueueFull):  # now the model's queue itself is full
        await adm.acquire(ticket(tenant="third"))
    await adm.release(holder)  # the first batch waiter is served: batch may queue one more
    served = await asyncio.wait_for(batch[0], GRANT_S)
    batch.append(await enqueue(adm, ticket(tenant="batch")))
    assert (await adm.snapshot())["models"]["m"]["tenants"] == {"batch": 2, "chat": 2}
    batch[1].cancel()  # a cancelled waiter gives its place back too
    await until(lambda: _tenant_waiting(adm, "batch", 1))
    await adm.release(served)
    for task in [*batch[1:], *others]:
        task.cancel()
    await asyncio.gather(*batch[1:], *others, return_exceptions=True)
    assert await depth(adm) == 0


async def _tenant_waiting(adm: Admission, tenant: str, n: int) -> bool:
    snap = await adm.snapshot()
    return bool(snap["models"]["m"]["tenants"].get(tenant, 0) == n)


async def test_retry_after_follows_the_drain_rate(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), max_queued=3, max_wait_s=60.0)
    for _ in range(40):  # 40 grants just now: about 4 grants/s with a 10 s memory
        await adm.release(await adm.acquire(ticket()))
    await adm.acquire(ticket())
    waiters = [await enqueue(adm, ticket()) for _ in range(3)]
    with pytest.raises(QueueFull) as err:
        await adm.acquire(ticket())
    assert 1.0 <= err.value.retry_after_s < 5.0  # position 4 at ~4/s, not the 60 s ceiling
    for w in waiters:
        w.cancel()


async def test_timeout_raises_queue_timeout_and_leaves_the_queue(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), max_wait_s=20.0)
    holder = await adm.acquire(ticket())
    with pytest.raises(QueueTimeout) as err:
        await adm.acquire(ticket(max_wait_s=0.2))
    assert 1.0 <= err.value.retry_after_s <= 20.0
    assert await depth(adm) == 0
    await adm.release(holder)
    assert await held(adm, "w1") == 0


async def test_priority_first_lower_number_first(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    holder = await adm.acquire(ticket())
    tasks = {}
    for name, prio in [("p5", 5), ("p0a", 0), ("p3", 3), ("p0b", 0), ("n1", -1)]:
        tasks[name] = await enqueue(adm, ticket(priority=prio, tenant=name))
    assert await _chain(adm, tasks, holder) == ["n1", "p0a", "p0b", "p3", "p5"]


async def test_one_tenants_backlog_does_not_delay_another_tenant(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    holder = await adm.acquire(ticket())
    tasks = {}
    for i in range(6):
        tasks[f"a{i}"] = await enqueue(adm, ticket(tenant="A"))
    tasks["b0"] = await enqueue(adm, ticket(tenant="B"))
    tasks["c0"] = await enqueue(adm, ticket(tenant="C"))
    tasks["b1"] = await enqueue(adm, ticket(tenant="B"))
    order = await _chain(adm, tasks, holder)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4", "a5"]


async def test_fairness_keeps_working_after_the_backlog_is_served(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    holder = await adm.acquire(ticket())
    tasks = {f"a{i}": await enqueue(adm, ticket(tenant="A")) for i in range(4)}
    # serve two of A's requests, then B arrives: B goes next, not after A's remaining two
    await adm.release(holder)
    l0 = await asyncio.wait_for(tasks.pop("a0"), GRANT_S)
    await adm.release(l0)
    l1 = await asyncio.wait_for(tasks.pop("a1"), GRANT_S)
    tasks["b0"] = await enqueue(adm, ticket(tenant="B"))
    assert await _chain(adm, tasks, l1) == ["b0", "a2", "a3"]


async def test_freed_slot_goes_to_the_best_eligible_waiter(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1, w2=1))
    on_w1 = await adm.acquire(ticket(("w1",)))
    on_w2 = await adm.acquire(ticket(("w2",)))
    only_w2 = await enqueue(adm, ticket(("w2",), priority=-5))
    either = await enqueue(adm, ticket(("w1", "w2"), priority=0))
    only_w1_low = await enqueue(adm, ticket(("w1",), priority=9))
    await adm.release(on_w1)  # best eligible for w1 is `either`; `only_w2` ranks higher but can't
    got = await asyncio.wait_for(either, GRANT_S)
    assert got.worker == "w1"
    assert not only_w2.done() and not only_w1_low.done()
    await adm.release(on_w2)
    assert (await asyncio.wait_for(only_w2, GRANT_S)).worker == "w2"
    await adm.release(got)
    assert (await asyncio.wait_for(only_w1_low, GRANT_S)).worker == "w1"


async def test_cancelled_waiter_is_never_granted(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    holder = await adm.acquire(ticket())
    gone = await enqueue(adm, ticket(priority=-1))
    stays = await enqueue(adm, ticket())
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await depth(adm) == 1
    await adm.release(holder)
    lease = await asyncio.wait_for(stays, GRANT_S)
    assert await held(adm, "w1") == 1
    await adm.release(lease)
    assert await held(adm, "w1") == 0


async def test_grant_racing_a_cancel_gives_the_slot_back(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    holder = await adm.acquire(ticket())
    racer = await enqueue(adm, ticket(priority=-1))
    next_in_line = await enqueue(adm, ticket())
    racer.cancel()  # the client goes away...
    await adm.release(holder)  # ...while the slot is being handed to it
    with pytest.raises(asyncio.CancelledError):
        await racer
    lease = await asyncio.wait_for(next_in_line, GRANT_S)  # so the slot moves on, not leaked
    await adm.release(lease)
    assert await held(adm, "w1") == 0


async def test_on_wait_reports_positions_about_every_keepalive(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), keepalive_interval_s=0.05)
    holder = await adm.acquire(ticket())
    first = await enqueue(adm, ticket())
    seen: list[int] = []
    at: list[float] = []  # loop time of each report
    loop = asyncio.get_running_loop()

    async def on_wait(position: int) -> None:
        seen.append(position)
        at.append(loop.time())

    async def four() -> bool:
        return len(seen) >= 4

    began = loop.time()
    waiter = asyncio.create_task(adm.acquire(ticket(), on_wait))
    # four reports, however long a loaded machine takes (a count in a fixed 0.33 s was a rate
    # that load lowers); none sooner than one keep-alive after the last (load only widens gaps)
    await until(four)
    gaps = [b - a for a, b in zip([began, *at], at, strict=False)]
    assert min(gaps) >= 0.05 - 1e-6 and set(seen) == {2}, gaps
    await adm.release(holder)
    await adm.release(await asyncio.wait_for(first, GRANT_S))
    await adm.release(await asyncio.wait_for(waiter, GRANT_S))


async def test_a_failing_on_wait_removes_the_waiter(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1), keepalive_interval_s=0.02)
    holder = await adm.acquire(ticket())

    async def on_wait(position: int) -> None:
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await adm.acquire(ticket(), on_wait)
    snap = await adm.snapshot()
    assert snap.get("redis_up", True)  # the client's I/O error is not a Redis outage
    assert snap["models"]["m"]["depth"] == 0
    await adm.release(holder)
    assert await held(adm, "w1") == 0


async def test_poke_hands_slots_out_when_a_worker_comes_back(make: Make) -> None:
    workers = FakeWorkers(w1=1)
    workers.down.add("w1")
    adm = await make(workers)
    waiter = await enqueue(adm, ticket())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    workers.down.clear()
    adm.poke("w1")
    assert (await asyncio.wait_for(waiter, GRANT_S)).worker == "w1"


async def test_poke_after_capacity_grows(make: Make) -> None:
    workers = FakeWorkers(w1=1)
    adm = await make(workers)
    await adm.acquire(ticket())
    waiter = await enqueue(adm, ticket())
    workers.caps["w1"] = 2
    adm.poke("w1")
    assert (await asyncio.wait_for(waiter, GRANT_S)).worker == "w1"
    assert await held(adm, "w1") == 2


async def test_snapshot_shows_depth_oldest_wait_tenants_and_holders(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    holder = await adm.acquire(ticket())
    waiters = [await enqueue(adm, ticket(tenant=t)) for t in ("A", "A", "B")]
    await asyncio.sleep(0.05)
    snap = await adm.snapshot()
    model = snap["models"]["m"]
    assert model["depth"] == 3
    assert model["oldest_wait_s"] >= 0.04
    assert model["tenants"] == {"A": 2, "B": 1}
    w1 = snap["workers"]["w1"]
    assert w1["held"] == 1
    assert w1["by_replica"] == {holder.extra["replica"]: 1}
    for w in waiters:
        w.cancel()


async def test_double_release_is_harmless(make: Make) -> None:
    adm = await make(FakeWorkers(w1=1))
    lease = await adm.acquire(ticket())
    await adm.release(lease)
    other = await adm.acquire(ticket())
    await adm.release(lease)
    assert await held(adm, "w1") == 1
    await adm.release(other)


async def test_take_now_grants_only_what_acquire_would_grant_at_once(make: Make) -> None:
    """The synchronous fast path: a lease when a slot is free and nobody waits ahead, else
    None (the caller then awaits ``acquire``); a backend that must ask its store returns
    None always. ``release_now`` frees at once where it can, and waiters get the slot."""
    adm = await make(FakeWorkers(w1=1))
    now = adm.take_now(ticket())
    if now is None:  # a store-backed backend: everything goes through acquire
        assert not adm.release_now(await adm.acquire(ticket()))
        return
    assert now.worker == "w1" and now.queued_s == 0.0
    assert adm.take_now(ticket()) is None  # full
    waiter = await enqueue(adm, ticket())
    assert adm.release_now(now)
    granted = await asyncio.wait_for(waiter, GRANT_S)  # the freed slot went to the waiter
    assert adm.take_now(ticket()) is None
    assert adm.release_now(granted) and adm.release_now(granted)  # twice is harmless
    assert await held(adm, "w1") == 0
    again = adm.take_now(ticket())
    assert again is not None
    adm.release_now(again)
