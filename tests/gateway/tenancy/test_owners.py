"""Where stored responses live: the memory store and the Redis one (shared by replicas)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from redis.asyncio import Redis

from gpupool.config.models import QueueConfig, TenancyConfig
from gpupool.gateway.admission.connection import StoreUnavailable
from gpupool.gateway.tenancy.owners import MemoryOwners, Owner, RedisOwners, build_owners
from tests.conftest import RedisServer
from tests.support.procs import free_port

A = Owner("w1", "team-a")


def test_memory_forgets_after_the_ttl_and_beyond_the_limit() -> None:
    async def go() -> None:
        owners = MemoryOwners(ttl_s=0.2, limit=2)
        await owners.remember("r1", A)
        assert await owners.find("r1") == A
        await asyncio.sleep(0.3)
        assert await owners.find("r1") is None
        for i in range(3):
            await owners.remember(f"r{i}", A)
        assert await owners.find("r0") is None  # the oldest went first
        assert await owners.find("r2") == A
        await owners.forget("r2")
        assert await owners.find("r2") is None

    asyncio.run(go())


def test_redis_is_shared_by_replicas_with_a_ttl(own_redis: RedisServer) -> None:
    async def go() -> None:
        queue = QueueConfig(backend="redis", redis_url=own_redis.url, redis_prefix="t")
        one = build_owners(TenancyConfig(stored_response_ttl_s=60), queue)
        two = build_owners(TenancyConfig(stored_response_ttl_s=60), queue)
        assert isinstance(one, RedisOwners) and isinstance(two, RedisOwners)
        try:
            await one.remember("resp_1", A)
            assert await two.find("resp_1") == A  # another replica finds it
            ttl = await two.redis.pttl("t:resp:resp_1")
            assert 0 < ttl <= 60_000
            await two.forget("resp_1")
            assert await two.find("resp_1") is None
            assert await one.redis.exists("t:resp:resp_1") == 0
        finally:
            await one.aclose()
            await two.aclose()

    asyncio.run(go())


def test_redis_down_keeps_what_this_replica_wrote(own_redis: RedisServer) -> None:
    async def go() -> None:
        queue = QueueConfig(backend="redis", redis_url=own_redis.url, lease_ttl_s=2)
        owners = build_owners(TenancyConfig(), queue)
        try:
            await own_redis.akill()
            await owners.remember("resp_2", A)  # logged, not raised
            assert await owners.find("resp_2") == A
            with pytest.raises(StoreUnavailable):  # nobody can say: not "unknown"
                await owners.find("resp_unknown")
            await owners.forget("resp_2")  # logged, not raised
        finally:
            await owners.aclose()

    asyncio.run(go())


def test_a_hung_redis_fails_every_call_within_its_deadline(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped Redis (SIGSTOP) answers nothing: each of many calls at once fails with
    ``StoreUnavailable`` (a pooled connection's wait is inside the deadline too), and what this
    replica wrote is still found."""

    async def go() -> None:
        queue = QueueConfig(backend="redis", redis_url=own_redis.url, lease_ttl_s=2)
        owners = build_owners(TenancyConfig(), queue)
        other = build_owners(TenancyConfig(), queue)
        assert isinstance(owners, RedisOwners) and owners.timeout_s == 1.0
        try:
            await other.remember("resp_other", A)
            await owners.remember("resp_mine", A)
            with stopped(own_redis):
                async with asyncio.timeout(120):  # a hang guard, not a measurement
                    found = await asyncio.gather(
                        *(owners.find(f"resp_{i}") for i in range(40)), return_exceptions=True
                    )
                    assert all(isinstance(f, StoreUnavailable) for f in found), found
                    with pytest.raises(StoreUnavailable):
                        await owners.find("resp_other")
                    assert await owners.find("resp_mine") == A
                    with caplog.at_level(logging.WARNING, logger="gpupool.tenancy"):
                        await owners.remember("resp_new", A)
            assert "resp_new: not written to Redis" in caplog.text
            assert await owners.find("resp_other") == A  # answering again
        finally:
            await owners.aclose()
            await other.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("refusal", ["oom", "readonly"])
def test_a_refusing_redis_is_logged_or_raised_never_a_bare_redis_error(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture, refusal: str
) -> None:
    """Writes a full Redis (``OOM``) or a replica (``READONLY``) refuses are logged and left to
    the memory copy; a lookup it refuses (a replica cut off from its primary with
    ``replica-serve-stale-data no``: ``MASTERDOWN``) is ``StoreUnavailable``."""

    async def go() -> None:
        queue = QueueConfig(backend="redis", redis_url=own_redis.url, lease_ttl_s=2)
        owners = build_owners(TenancyConfig(), queue)
        other = build_owners(TenancyConfig(), queue)
        assert isinstance(owners, RedisOwners)
        try:
            await other.remember("resp_other", A)
            async with refusing(owners.redis, refusal):
                with caplog.at_level(logging.WARNING, logger="gpupool.tenancy"):
                    await owners.remember("resp_mine", A)
                    assert await owners.find("resp_mine") == A
                    if refusal == "oom":  # reads still work
                        assert await owners.find("resp_other") == A
                    else:
                        with pytest.raises(StoreUnavailable, match="MasterDown"):
                            await owners.find("resp_other")
                    await owners.forget("resp_mine")
            assert "resp_mine: not written to Redis" in caplog.text
            assert await other.find("resp_mine") is None  # it never got there
            assert await other.find("resp_other") == A
        finally:
            await owners.aclose()
            await other.aclose()

    asyncio.run(go())


@contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    """``server`` frozen (SIGSTOP: connections open, nothing answered), then thawed."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


@asynccontextmanager
async def refusing(redis: Redis, how: str) -> AsyncIterator[None]:
    """Redis refusing writes: full (``maxmemory`` 1, no eviction) or a read-only replica of a
    primary that is not there (reads refused too), then itself again."""
    if how == "oom":
        await redis.config_set("maxmemory-policy", "noeviction")
        await redis.config_set("maxmemory", 1)
    else:
        await redis.config_set("replica-serve-stale-data", "no")
        await redis.replicaof("127.0.0.1", free_port())
    try:
        yield
    finally:
        if how == "oom":
            await redis.config_set("maxmemory", 0)
        else:
            await redis.replicaof("NO", "ONE")


def test_memory_is_the_default() -> None:
    assert isinstance(build_owners(TenancyConfig(), QueueConfig()), MemoryOwners)
