"""A hold given back while a renewal naming it is on its way is not counted again.

The renewal (control client) and the give (request pool) travel over different connections, so
a renewal that named a hold can reach Redis after that hold's give: it re-asserts the hold, and
the key's ``max_concurrent`` stayed blocked by a request that had ended until the lease expired.
CI saw it in the hostile-worker suite (the first renewal reconnects and loads its script, a few
round trips, while the ``trickle`` case's request ends); here the renewal is held on its way.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from gpupool.config.models import ApiKey
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits import KeyLimits
from gpupool.gateway.security.limits.redis_store import RedisLimits
from tests.conftest import RedisServer

TTL_S = 3.0  # renewals every second; a re-asserted hold would count for 3 s


@pytest.fixture
async def limits(redis_server: RedisServer) -> AsyncIterator[KeyLimits]:
    made = KeyLimits(redis_server.url, f"renewal-{uuid.uuid4().hex[:8]}", lease_ttl_s=TTL_S)
    yield made
    await made.aclose()


class LateRenewal:
    """``RedisLimits.renew``, held after it was called with a hold until ``go`` is set."""

    def __init__(self) -> None:
        self.named = asyncio.Event()  # a renewal naming a hold was called (its list is made)
        self.go = asyncio.Event()
        self.landed = asyncio.Event()
        self._renew = RedisLimits.renew

    async def renew(self, store: RedisLimits, holds: list[tuple[str, str]]) -> None:
        if holds and not self.named.is_set():
            self.named.set()
            await self.go.wait()
            await self._renew(store, holds)
            self.landed.set()
            return
        await self._renew(store, holds)


async def test_a_renewal_landing_after_the_give_does_not_hold_the_slot_again(
    limits: KeyLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    late = LateRenewal()

    async def renew(store: RedisLimits, holds: list[tuple[str, str]]) -> None:
        await late.renew(store, holds)

    monkeypatch.setattr(RedisLimits, "renew", renew)
    alice = Principal("alice", "alice", key=ApiKey(name="alice", sha256="a" * 64,
                                                    max_concurrent=1))  # fmt: skip
    hold = await limits.admit(alice)
    await asyncio.wait_for(late.named.wait(), 3 * TTL_S)  # the renewal's list names the hold
    await hold.close(None)  # the request ends: its give reaches Redis first
    assert await limits.in_use("alice") == 0
    late.go.set()  # then the renewal, which re-asserts the hold in Redis
    await asyncio.wait_for(late.landed.wait(), TTL_S)
    began = time.monotonic()
    while await limits.in_use("alice"):  # given again at once, not left to its lease
        # a re-asserted hold lasts its whole TTL (3 s); 2 s leaves a loaded machine's Redis
        # round trips more than the 1 s (one renewal period) this bound once was
        assert time.monotonic() - began < TTL_S * 2 / 3, "the ended request's slot is held again"
        await asyncio.sleep(0.02)
    await (await limits.admit(alice)).close(None)  # the key's only slot is free
