"""Redis under a burst: a busy client pool is not an outage, and capacity stays exact.

Two replicas share one real ``redis-server``; 2,000 acquires arrive at once (1,000 on each), far
more than the client pool has connections. Every one must wait its turn: none may see Redis as
unreachable (that would switch the replica to its local share and run work above capacity), no
worker may hold more leases than its capacity, and nothing may be left held or queued afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from gpupool.gateway.admission.base import Lease
from gpupool.gateway.admission.redis_backend import RedisAdmission

from .conftest import FakeWorkers, depth, held, ticket

MakeRedis = Callable[..., Awaitable[RedisAdmission]]
CAPS = {"w1": 3, "w2": 2}
BURST = 2000


class Peak:
    """Leases running per worker, across replicas, and the most seen at once."""

    def __init__(self) -> None:
        self.now = dict.fromkeys(CAPS, 0)
        self.peak = dict.fromkeys(CAPS, 0)
        self.served = 0

    def enter(self, lease: Lease) -> None:
        self.now[lease.worker] += 1
        self.peak[lease.worker] = max(self.peak[lease.worker], self.now[lease.worker])

    def leave(self, lease: Lease) -> None:
        self.now[lease.worker] -= 1
        self.served += 1


async def _one(adm: RedisAdmission, peak: Peak) -> None:
    lease = await adm.acquire(ticket(("w1", "w2"), tenant=f"t{id(adm) % 7}", max_wait_s=120.0))
    peak.enter(lease)
    try:
        await asyncio.sleep(0)
    finally:
        peak.leave(lease)
        await adm.release(lease)


async def test_a_burst_waits_for_connections_and_never_exceeds_capacity(
    make_redis: MakeRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpupool.gateway.admission.redis_backend")
    workers = FakeWorkers(**CAPS)
    kw = {"max_queued": 10 * BURST, "lease_ttl_s": 2.0}  # calls time out after 1 s
    a = await make_redis(workers, **kw)
    b = await make_redis(workers, **kw)
    peak = Peak()
    burst = [_one(a if i % 2 else b, peak) for i in range(BURST)]
    await asyncio.wait_for(asyncio.gather(*burst), 240)

    assert "Redis unreachable" not in caplog.text
    assert a.redis_up and b.redis_up
    assert peak.served == BURST
    assert peak.peak == CAPS  # every slot used, none over, across both replicas
    for adm in (a, b):
        assert await depth(adm) == 0
        for name in CAPS:
            assert await held(adm, name) == 0
        snap = await adm.snapshot()
        assert snap["local"]["workers"].get("w1", {}).get("held", 0) == 0
