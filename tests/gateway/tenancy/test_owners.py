"""Where stored responses live: the memory store and the Redis one (shared by replicas)."""

from __future__ import annotations

import asyncio

from gpupool.config.models import QueueConfig, TenancyConfig
from gpupool.gateway.tenancy.owners import MemoryOwners, Owner, RedisOwners, build_owners
from tests.conftest import RedisServer

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
            assert await owners.find("resp_unknown") is None
        finally:
            await owners.aclose()

    asyncio.run(go())


def test_memory_is_the_default() -> None:
    assert isinstance(build_owners(TenancyConfig(), QueueConfig()), MemoryOwners)
