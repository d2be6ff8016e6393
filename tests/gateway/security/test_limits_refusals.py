"""Per-key limits on a real ``redis-server`` that answers with errors (full: ``OOM``; a
read-only replica: ``READONLY``). A ``PING`` still answers there, so the limits must not wait
for the probe: they fail open to this replica's own at the first refusal, stay there while
Redis refuses writes, and share again once a renewal (a write) succeeds. A hold taken in Redis
before and given back while Redis refused is counted nowhere afterwards."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from gpupool.gateway.errors import RateLimited
from gpupool.gateway.security.limits import KeyLimits
from tests.conftest import RedisServer
from tests.gateway.admission.test_redis_refusals import refusing
from tests.gateway.security.test_limits import principal

TTL_S = 1.0
PREFIX = "refusals"


@pytest.fixture
async def redis(own_redis: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
async def limits(own_redis: RedisServer) -> AsyncIterator[KeyLimits]:
    made = KeyLimits(own_redis.url, PREFIX, lease_ttl_s=TTL_S)
    yield made
    await made.aclose()


async def _until(check: Callable[[], bool], within_s: float = 60) -> None:
    """Wait for ``check()`` to be true (a hang guard, not a measurement)."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s:g}s"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", ["oom", "readonly"])
async def test_limits_fail_open_while_redis_refuses_and_nothing_stays_held(
    limits: KeyLimits, redis: Redis, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    # max_concurrent alone: taking a slot's first write is the hold's ZADD, which a full Redis
    # refuses (an rpm or tpm window's trim first would let the script write on)
    alice = principal(max_concurrent=2)
    shared = await limits.admit(alice, 0)
    assert await redis.zcard(f"{PREFIX}:kl:c:alice") == 1
    with caplog.at_level(logging.WARNING, logger="gpupool.limits"):
        async with refusing(redis, how):
            local = await limits.admit(alice, 0)  # its hold refused: this replica's limits
            assert not limits.redis_up
            other = await limits.admit(alice, 0)  # the shared hold is out of sight here
            with pytest.raises(RateLimited):
                await limits.admit(alice, 0)  # still limited on this replica
            await shared.close(None)  # refused by a read-only Redis: owed, not counted here
            await local.close(None)
            await other.close(None)
            assert limits.holders() == set() and await limits.in_use("alice") == 0
            await asyncio.sleep(3 * TTL_S)  # renewals meanwhile: PING answers, writes refused
            assert not limits.redis_up
    cause = "OutOfMemoryError" if how == "oom" else "ReadOnlyError"
    assert f"Redis refused a call ({cause}" in caplog.text, caplog.text
    await _until(lambda: limits.redis_up)
    assert await limits.in_use("alice") == 0  # the owed give reached Redis, or its lease expired
    assert await redis.zcard(f"{PREFIX}:kl:c:alice") == 0
    again = await limits.admit(alice, 0)
    assert await limits.in_use("alice") == 1
    await again.close(None)
    assert await limits.in_use("alice") == 0


async def test_a_script_flush_is_not_seen(limits: KeyLimits, redis: Redis) -> None:
    alice = principal(max_concurrent=2, rpm=1000, tpm=100_000)
    for _ in range(3):
        hold = await limits.admit(alice, 10)
        assert await redis.script_flush()
        assert await limits.in_use("alice") == 1
        assert await redis.script_flush()
        await hold.close(5)
    assert limits.redis_up and await limits.in_use("alice") == 0
