"""A key's token budget stays exact whatever usage a worker reports (issue 26).

A worker is only semi-trusted: its usage of 10^30 tokens, a negative count, a string or a float
reaches the limit stores as ``used``. On the memory store and through a real ``redis-server``,
each is clamped (an integer in ``[0, MAX_TOKENS]``), no script fails half way, and the next
request is admitted or refused on exact arithmetic.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from gpupool.gateway.security.limits.base import MAX_TOKENS, LimitStore, Policy, tokens_of
from gpupool.gateway.security.limits.memory import MemoryLimits
from gpupool.gateway.security.limits.redis_store import RedisLimits
from tests.conftest import RedisServer

TPM = 1000
POLICY = Policy(tpm=TPM, max_concurrent=4)
HOSTILE: list[object] = [1e30, 10**30, -5, -1e30, "12", "x", 2.5, float("nan"), float("inf"), True]


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, redis_server: RedisServer
) -> AsyncIterator[LimitStore]:
    if request.param == "memory":
        yield MemoryLimits()
        return
    redis = RedisLimits(redis_server.url, f"hostile-{uuid.uuid4().hex[:8]}", lease_ttl_s=5.0)
    yield redis
    await redis.aclose()


def test_tokens_of_clamps_every_kind_of_value() -> None:
    assert [tokens_of(v) for v in HOSTILE] == [
        MAX_TOKENS,
        MAX_TOKENS,
        0,
        0,
        0,
        0,
        2,
        0,
        MAX_TOKENS,
        0,
    ]
    assert tokens_of(0) == 0 and tokens_of(17) == 17


@pytest.mark.parametrize("used", HOSTILE, ids=repr)
async def test_any_usage_settles_without_breaking_the_budget(
    store: LimitStore, used: object
) -> None:
    """Settled with a hostile ``used``: nothing raises, nothing is held, and the minute's tokens
    are the clamped number; a budget at its cap refuses the next request (a 429 with a
    wait), never an error, and a zero leaves the whole budget free."""
    name = f"k-{uuid.uuid4().hex[:6]}"
    assert await store.take(name, POLICY, "h1", 100) is None
    await store.give(name, POLICY, "h1", 100, used)  # type: ignore[arg-type]
    usage = await store.usage(name)
    assert usage.in_use == 0 and usage.reserved == 0
    assert usage.tokens == tokens_of(used)
    refusal = await store.take(name, POLICY, "h2", 10)
    if tokens_of(used) + 10 > TPM:
        assert refusal is not None and refusal.limit == "tpm" and 0 < refusal.retry_after_s <= 60
    else:
        assert refusal is None
        await store.give(name, POLICY, "h2", 10, 10)
        assert (await store.usage(name)).tokens == tokens_of(used) + 10


@pytest.mark.parametrize("charge", [1e30, -7, "9", 3.9], ids=repr)
async def test_any_charge_is_taken_and_given_back_exactly(
    store: LimitStore, charge: object
) -> None:
    name = f"k-{uuid.uuid4().hex[:6]}"
    first = await store.take(name, POLICY, "h1", charge)  # type: ignore[arg-type]
    if tokens_of(charge) > TPM:
        assert first is not None and first.limit == "tpm"
        assert (await store.usage(name)).in_use == 0  # refused: nothing recorded
        return
    assert first is None
    await store.give(name, POLICY, "h1", charge, None)  # type: ignore[arg-type]
    usage = await store.usage(name)
    assert (usage.in_use, usage.reserved, usage.tokens) == (0, 0, tokens_of(charge))
