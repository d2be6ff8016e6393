"""Swap groups' Redis claims (``gateway/swap_lease.py``) against a real redis-server."""

from __future__ import annotations

import asyncio

from gpupool.gateway.admission.connection import redis_client
from gpupool.gateway.swap_lease import SwapLeases
from tests.conftest import RedisServer

TTL_S = 0.2  # renew every 0.2 s, claims lapse 0.6 s after their renewal


def _leases(redis: RedisServer, replica: str, prefix: str) -> SwapLeases:
    keys = {"a": f"{prefix}:swap:a:1", "b": f"{prefix}:swap:b:2"}
    return SwapLeases(redis_client(redis.url, TTL_S, max_connections=2), keys, replica, TTL_S)


async def test_a_holder_that_loses_one_group_gives_up_all_so_a_standby_can_take_them(
    redis_server: RedisServer,
) -> None:
    """A standby takes every group or none. Were a holder that found one group's claim taken
    (its key lapsed while it was frozen; the standby took it, then found the next one renewed
    and gave the first back) to keep renewing the rest, the standby would wait for ever and
    the holder, fenced for good, switch nothing: no replica would control either group."""
    holder = _leases(redis_server, "holder", "lose-one")
    standby = _leases(redis_server, "standby", "lose-one")
    await holder.claim()
    lost: dict[str, str] = {}
    all_lost = asyncio.Event()

    async def on_lost(group: str, by: str) -> None:
        lost[group] = by
        if len(lost) == len(holder.keys):
            all_lost.set()

    await holder.client.set(holder.keys["a"], "standby")  # (no TTL: however slow the renewal)
    holder.start(on_lost)
    try:
        await asyncio.wait_for(all_lost.wait(), 5)
        await standby.client.delete(holder.keys["a"])  # the standby gave "a" back
        await asyncio.wait_for(standby.claim(), 10)
        assert lost == {"a": "standby", "b": "standby"} and not holder.fresh()
        values = [await standby.client.get(k) for k in standby.keys.values()]
        assert values == ["standby", "standby"]
    finally:
        await holder.close()
        await standby.close()
