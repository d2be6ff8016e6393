"""Redis-only behaviour: replicas sharing slots, replicas dying, Redis dying and coming back."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from gpupool.config.models import QueueBackend, QueueConfig
from gpupool.gateway.admission.factory import build_admission, new_replica_id
from gpupool.gateway.admission.fairness import encode_key
from gpupool.gateway.admission.memory import MemoryAdmission
from gpupool.gateway.admission.redis_backend import RedisAdmission
from gpupool.gateway.errors import ServiceUnavailable
from tests.conftest import RedisServer

from .conftest import GRANT_S, FakeWorkers, depth, enqueue, held, ticket, until
from .replica_proc import TTL_S

MakeRedis = Callable[..., Awaitable[RedisAdmission]]
ROOT = Path(__file__).resolve().parents[2]


def _up(adm: RedisAdmission, up: bool = True) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return adm.redis_up is up

    return check


async def test_two_replicas_share_capacity_and_wake_each_other(make_redis: MakeRedis) -> None:
    workers = FakeWorkers(w1=2)
    # the periodic re-check is off: the hand-over must come through pub/sub
    a = await make_redis(workers, recheck=30.0)
    b = await make_redis(workers, recheck=30.0)
    la = await a.acquire(ticket())
    lb = await b.acquire(ticket())
    waiting = await enqueue(b, ticket())
    snap = await a.snapshot()
    assert snap["workers"]["w1"]["by_replica"] == {a.replica_id: 1, b.replica_id: 1}
    assert snap["models"]["m"]["depth"] == 1
    t0 = time.monotonic()
    await a.release(la)
    lease = await asyncio.wait_for(waiting, 15)
    # through pub/sub: the re-check would take 30 s; 10 s leaves a loaded machine its stalls
    assert time.monotonic() - t0 < 10
    assert lease.extra["replica"] == b.replica_id
    assert (await b.snapshot())["workers"]["w1"]["by_replica"] == {b.replica_id: 2}
    await b.release(lease)
    await b.release(lb)
    assert await held(a, "w1") == 0


async def test_a_lost_wake_up_message_is_recovered_by_the_recheck(
    make_redis: MakeRedis, redis_server: RedisServer
) -> None:
    workers = FakeWorkers(w1=1)
    a = await make_redis(workers, recheck=30.0)
    b = await make_redis(workers, recheck=0.1)
    holder = await a.acquire(ticket())
    waiting = await enqueue(b, ticket())
    raw = Redis.from_url(redis_server.url)
    await raw.client_kill_filter(_type="pubsub")  # b hears nothing now
    await a.release(holder)  # the grant is published to nobody
    lease = await asyncio.wait_for(waiting, 15)  # without the re-check: never
    assert lease.worker == "w1"
    await b.release(lease)
    await raw.aclose()


async def _replica_process(url: str, prefix: str, mode: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.admission.replica_proc",
        url,
        prefix,
        mode,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert line.strip() in (b"held", b"queued")
    return proc


async def test_a_killed_replicas_slots_come_back_within_the_ttl(
    make_redis: MakeRedis, redis_server: RedisServer
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    b = await make_redis(FakeWorkers(w1=1), redis_prefix=prefix, lease_ttl_s=TTL_S)
    proc = await _replica_process(redis_server.url, prefix, "hold")
    waiting = asyncio.create_task(b.acquire(ticket()))
    await asyncio.sleep(TTL_S + 0.5)  # past the TTL: the live replica keeps renewing its lease
    assert not waiting.done()
    proc.kill()  # SIGKILL: no release, no goodbye
    await proc.wait()
    # the slot comes back only when the dead replica's lease runs out in Redis (nothing
    # releases it): a bound of the TTL plus a loaded machine's stalls
    lease = await asyncio.wait_for(waiting, TTL_S + 10)
    await b.release(lease)


async def test_a_killed_replicas_waiters_leave_the_queue(
    make_redis: MakeRedis, redis_server: RedisServer
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    b = await make_redis(FakeWorkers(w1=1), redis_prefix=prefix, lease_ttl_s=TTL_S)
    holder = await b.acquire(ticket())
    proc = await _replica_process(redis_server.url, prefix, "wait")
    assert await depth(b) == 1
    proc.kill()
    await proc.wait()

    async def empty() -> bool:
        return await depth(b) == 0

    await until(empty, TTL_S + 10)
    await b.release(holder)  # nobody to hand it to: the ghost is gone
    assert await held(b, "w1") == 0
    assert (await b.acquire(ticket())).queued_s == 0.0


async def test_a_waiter_survives_an_outage_and_its_lease_is_reasserted(
    make_redis: MakeRedis, own_redis: RedisServer
) -> None:
    adm = await make_redis(FakeWorkers(w1=1), url=own_redis.url, recheck=0.05)
    holder = await adm.acquire(ticket())
    waiting = await enqueue(adm, ticket())
    await own_redis.akill()
    await until(_up(adm, False))
    await adm.release(holder)  # counted in the local share, so this frees it locally
    lease = await asyncio.wait_for(waiting, 15)
    assert lease.extra["via"] == "local"
    await own_redis.astart()  # empty: nothing survived
    await until(_up(adm))
    snap = await adm.snapshot()
    assert snap["workers"]["w1"]["by_replica"] == {adm.replica_id: 1}  # re-asserted
    await adm.release(lease)
    assert await held(adm, "w1") == 0


async def test_reject_policy_returns_503_until_redis_is_back(
    make_redis: MakeRedis, own_redis: RedisServer
) -> None:
    adm = await make_redis(
        FakeWorkers(w1=2), url=own_redis.url, recheck=0.05, on_redis_down="reject"
    )
    lease = await adm.acquire(ticket())
    await own_redis.akill()
    with pytest.raises(ServiceUnavailable) as err:
        await adm.acquire(ticket())
    assert err.value.status == 503
    await adm.release(lease)  # no error while down
    await own_redis.astart()
    await until(_up(adm))
    again = await adm.acquire(ticket())
    assert again.extra["via"] == "redis"
    await adm.release(again)
    assert await held(adm, "w1") == 0


async def test_a_queued_request_gets_503_when_redis_dies_under_reject(
    make_redis: MakeRedis, own_redis: RedisServer
) -> None:
    adm = await make_redis(
        FakeWorkers(w1=1), url=own_redis.url, recheck=0.05, on_redis_down="reject"
    )
    await adm.acquire(ticket())
    waiting = await enqueue(adm, ticket())
    await own_redis.akill()
    with pytest.raises(ServiceUnavailable):
        await asyncio.wait_for(waiting, GRANT_S)


async def test_starting_with_redis_down_serves_locally_then_switches(
    make_redis: MakeRedis, own_redis: RedisServer
) -> None:
    await own_redis.akill()
    adm = await make_redis(FakeWorkers(w1=3), url=own_redis.url, recheck=0.05, replicas_hint=2)
    assert not adm.redis_up
    local = await adm.acquire(ticket())
    assert local.extra["via"] == "local"
    waiting = await enqueue(adm, ticket())  # share: 3 // 2 = 1 slot while Redis is away
    await own_redis.astart()
    await until(_up(adm))
    # the local waiter moved to Redis, where the full capacity (3) applies
    moved = await asyncio.wait_for(waiting, GRANT_S)
    assert moved.extra["via"] == "redis"
    assert (await adm.snapshot())["workers"]["w1"]["held"] == 2
    await adm.release(local)
    await adm.release(moved)
    assert await held(adm, "w1") == 0


class _Load:
    """Clients looping acquire -> hold -> release; per-phase peak concurrency."""

    def __init__(self, replicas: list[RedisAdmission]) -> None:
        self.replicas = replicas
        self.now: dict[str, int] = {r.replica_id: 0 for r in replicas}
        self.phase = "redis"
        self.peaks: dict[str, dict[str, int]] = {}
        self.served: dict[str, int] = {}
        self.held_via: dict[str, int] = {"redis": 0, "local": 0}  # leases out, by how granted
        self.errors: list[BaseException] = []
        self.running = True

    def _enter(self, rid: str) -> None:
        self.now[rid] += 1
        peak = self.peaks.setdefault(self.phase, {})
        peak[rid] = max(peak.get(rid, 0), self.now[rid])
        peak["total"] = max(peak.get("total", 0), sum(self.now.values()))
        self.served[self.phase] = self.served.get(self.phase, 0) + 1

    async def client(self, adm: RedisAdmission) -> None:
        while self.running:
            try:
                lease = await adm.acquire(ticket(max_wait_s=5.0))
            except Exception as exc:
                self.errors.append(exc)
                continue
            self._enter(adm.replica_id)
            via = lease.extra["via"]
            self.held_via[via] += 1
            try:
                await asyncio.sleep(0.005)
            finally:
                self.now[adm.replica_id] -= 1
                await adm.release(lease)
                self.held_via[via] -= 1

    async def drained(self, via: str) -> None:
        """Wait until no lease granted ``via`` is held (an event, not a time: under load one
        client's 5-ms hold can last far longer)."""

        async def none_out() -> bool:
            return self.held_via[via] == 0

        await until(none_out, within=20.0)

    async def serves(self, n: int = 20) -> None:
        """Stay in this phase until it has served more than ``n`` (a count, not a time: a busy
        machine serves fewer in a fixed time, and the test is about what, not how fast)."""

        async def enough() -> bool:
            return self.served.get(self.phase, 0) > n

        await until(enough, within=20.0)


async def test_redis_killed_and_restarted_under_load(
    make_redis: MakeRedis, own_redis: RedisServer
) -> None:
    workers = FakeWorkers(w1=4)
    kw: dict[str, Any] = {"url": own_redis.url, "recheck": 0.05, "replicas_hint": 2}
    a = await make_redis(workers, lease_ttl_s=5.0, **kw)
    b = await make_redis(workers, lease_ttl_s=5.0, **kw)
    load = _Load([a, b])
    clients = [asyncio.create_task(load.client(r)) for r in (a, b) for _ in range(5)]
    await load.serves()
    load.phase = "failing-over"  # a replica below its share may add to the others' Redis leases
    await own_redis.akill()
    await until(_up(a, False))
    await until(_up(b, False))
    await load.drained("redis")  # the leases taken through Redis are all given back
    load.phase = "outage"
    await load.serves()
    load.phase = "recovering"
    await own_redis.astart()
    await until(_up(a))
    await until(_up(b))
    await load.drained("local")  # the leases taken while Redis was away are all given back
    load.phase = "recovered"
    await load.serves()
    load.running = False
    # each client ends after its last acquire (at most max_wait_s, 5 s) and that lease's release
    await asyncio.wait_for(asyncio.gather(*clients), 5 + GRANT_S)

    seen = f"peaks={load.peaks} served={load.served}"
    assert load.errors == []  # the `local` policy served everyone
    assert load.peaks["redis"]["total"] == 4, seen
    assert load.peaks["outage"][a.replica_id] <= 2, seen
    assert load.peaks["outage"][b.replica_id] <= 2, seen
    assert load.served["outage"] > 20, seen
    assert load.peaks["recovered"]["total"] <= 4, seen
    assert load.served["recovered"] > 20, seen
    snap = await a.snapshot()
    assert snap["workers"]["w1"]["held"] == 0  # no slot leaked (TTL is 5 s: not hidden by it)
    assert snap["local"]["workers"]["w1"]["held"] == 0


async def test_every_key_lives_under_the_prefix(
    make_redis: MakeRedis, redis_server: RedisServer
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    adm = await make_redis(FakeWorkers(w1=1), redis_prefix=prefix)
    raw = Redis.from_url(redis_server.url, decode_responses=True)
    before = {k async for k in raw.scan_iter(f"{prefix}:*")}
    assert before  # the heartbeat at least
    holder = await adm.acquire(ticket())
    waiting = await enqueue(adm, ticket(tenant="x", priority=-3))
    # the Lua encodes order keys exactly as fairness.encode_key documents
    [member] = await raw.zrange(f"{prefix}:q:m", 0, -1)
    assert isinstance(member, str)
    assert member == encode_key((-3, 0, 1), member.split(":", 3)[3])
    keys = {k async for k in raw.scan_iter("*")}
    mine = {k for k in keys if k.startswith(f"{prefix}:")}
    assert {f"{prefix}:q:m", f"{prefix}:w:w1", f"{prefix}:s:w1", f"{prefix}:fair:m"} <= mine
    assert not {k for k in keys if prefix in k and not k.startswith(f"{prefix}:")}
    await adm.release(holder)
    await adm.release(await waiting)
    await raw.aclose()


def test_factory_builds_the_configured_backend() -> None:
    workers = FakeWorkers(w1=1)
    assert isinstance(build_admission(QueueConfig(), workers), MemoryAdmission)
    cfg = QueueConfig(backend=QueueBackend.redis)
    adm = build_admission(cfg, workers, replica_id="r1")
    assert isinstance(adm, RedisAdmission) and adm.replica_id == "r1"
    host, pid, rand = new_replica_id().split(":")
    assert host and pid.isdigit() and len(rand) == 6


async def test_a_hung_redis_is_found_by_the_probe_and_served_locally(
    make_redis: MakeRedis, own_redis: RedisServer
) -> None:
    """An outage without a refused connection: Redis stops answering (SIGSTOP)."""
    adm = await make_redis(FakeWorkers(w1=2), url=own_redis.url, recheck=0.05)
    first = await adm.acquire(ticket())
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        # the call times out, the probe's PING times out too: down, served on the local share
        lease = await asyncio.wait_for(adm.acquire(ticket()), 10)
        assert lease.extra["via"] == "local" and not adm.redis_up
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    await until(_up(adm), 10)
    await adm.release(lease)
    await adm.release(first)
    assert await held(adm, "w1") == 0
