"""Admission fixtures: a fake worker view and the backends on it (the ``redis-server``
fixtures, ``redis_server`` and ``own_redis``, are in ``tests/conftest.py``)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gpupool.config.models import QueueConfig
from gpupool.gateway.admission.base import Admission, Lease, Ticket
from gpupool.gateway.admission.memory import MemoryAdmission
from gpupool.gateway.admission.redis_backend import RedisAdmission
from tests.conftest import RedisServer


class FakeWorkers:
    """A ``WorkerView``: capacities by name; names in ``down`` are unavailable."""

    def __init__(self, **caps: int) -> None:
        self.caps = dict(caps)
        self.down: set[str] = set()

    def capacity(self, worker: str) -> int:
        return self.caps.get(worker, 0)

    def available(self, worker: str) -> bool:
        return worker in self.caps and worker not in self.down

    def slots(self, worker: str) -> int:
        return self.capacity(worker) if self.available(worker) else 0


_ids = itertools.count(1)

# How long a test waits for a grant it expects. A grant is an event, so this bound only catches
# one that never comes: 10 s, a ticket's own wait, as through Redis beside a loaded machine's other
# work a grant took longer than the 2 s these tests once gave it (and `until` below ran out of 3 s)
GRANT_S = 10.0


def ticket(
    candidates: tuple[str, ...] = ("w1",),
    *,
    tenant: str = "t",
    priority: int = 0,
    model: str = "m",
    max_wait_s: float = 10.0,
) -> Ticket:
    return Ticket(
        id=f"req-{next(_ids)}",
        model=model,
        tenant=tenant,
        priority=priority,
        candidates=list(candidates),
        max_wait_s=max_wait_s,
    )


async def until(pred: Callable[[], Awaitable[bool]], within: float = 15.0) -> None:
    """Wait for ``pred`` (15 s: three Redis-backed tests ran out of 3 s together on a quiet
    fresh-clone run while the Docker images built beside them)."""
    deadline = time.monotonic() + within
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def depth(adm: Admission, model: str = "m") -> int:
    snap = await adm.snapshot()
    return int(snap["models"].get(model, {}).get("depth", 0))


async def enqueue(adm: Admission, t: Ticket) -> asyncio.Task[Lease]:
    """Start an acquire that must queue, and return once it is in the queue."""
    before = await depth(adm, t.model)
    task = asyncio.create_task(adm.acquire(t))

    async def queued() -> bool:
        return await depth(adm, t.model) > before

    await until(queued)
    return task


async def held(adm: Admission, worker: str) -> int:
    snap = await adm.snapshot()
    return int(snap["workers"].get(worker, {}).get("held", 0))


Make = Callable[..., Awaitable[Admission]]


def queue_config(redis_url: str, **overrides: Any) -> QueueConfig:
    base: dict[str, Any] = {
        "redis_url": redis_url,
        "redis_prefix": f"test-{uuid.uuid4().hex[:8]}",
        "keepalive_interval_s": 0.05,
        "lease_ttl_s": 2.0,
    }
    return QueueConfig(**(base | overrides))


@pytest.fixture
async def make_redis(redis_server: RedisServer) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Build started ``RedisAdmission`` replicas (same prefix unless given); closed afterwards."""
    made: list[RedisAdmission] = []
    prefix = f"test-{uuid.uuid4().hex[:8]}"

    async def build(
        workers: FakeWorkers, *, url: str | None = None, recheck: float | None = None, **kw: Any
    ) -> RedisAdmission:
        kw.setdefault("redis_prefix", prefix)
        cfg = queue_config(url or redis_server.url, **kw)
        rid = f"replica-{len(made)}:{os.getpid()}:{uuid.uuid4().hex[:4]}"
        adm = RedisAdmission(cfg, workers, replica_id=rid, recheck_interval_s=recheck)
        await adm.start()
        made.append(adm)
        return adm

    yield build
    for adm in made:
        await adm.close()


@pytest.fixture(params=["memory", "redis"])
async def make(
    request: pytest.FixtureRequest, make_redis: Callable[..., Awaitable[Any]]
) -> AsyncIterator[Make]:
    """Build a started admission of the parametrized backend over ``workers``."""
    made: list[MemoryAdmission] = []

    async def build(workers: FakeWorkers, *, recheck: float | None = None, **kw: Any) -> Admission:
        if request.param == "redis":
            adm: Admission = await make_redis(workers, recheck=recheck, **kw)
            return adm
        cfg = queue_config("redis://unused", **kw)
        mem = MemoryAdmission.from_config(cfg, workers, "mem-replica")
        made.append(mem)
        return mem

    yield build
    for mem in made:
        await mem.close()
