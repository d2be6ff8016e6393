"""Per-key limits: requests per minute, tokens per minute, concurrent requests.

Rates use the ``limits`` library (sliding-window counters), in memory or in Redis when the queue
uses Redis, so every replica sees one budget. Tokens are counted from ``usage`` when a response
ends (prompt plus completion); a key whose token budget is spent is refused until the window
moves on. If Redis is unreachable, rate limits fail open (logged): availability over strictness.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from gpupool.config.models import ApiKey
from gpupool.gateway.errors import RateLimited
from gpupool.gateway.security.keys import Principal

log = logging.getLogger("gpupool.limits")


class _Concurrency:
    """Concurrent requests per key, in this process."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}

    def take(self, name: str, limit: int) -> bool:
        n = self._n.get(name, 0)
        if n >= limit:
            return False
        self._n[name] = n + 1
        return True

    def give(self, name: str) -> None:
        self._n[name] = max(0, self._n.get(name, 1) - 1)


@dataclass
class Hold:
    """One admitted request under a key; ``close(tokens)`` exactly once when it ends."""

    limits: KeyLimits | None
    principal: Principal | None
    closed: bool = False

    async def close(self, tokens: int | None) -> None:
        if self.closed or self.limits is None or self.principal is None:
            return
        self.closed = True
        await self.limits.done(self.principal, tokens or 0)


class KeyLimits:
    default_completion_tokens = 4096

    def __init__(self, redis_url: str | None = None, prefix: str = "gpupool") -> None:
        storage: Storage
        if redis_url:
            storage = RedisStorage(redis_url, key_prefix=f"{prefix}:limits")
        else:
            storage = MemoryStorage()
        self.limiter = SlidingWindowCounterRateLimiter(storage)
        self.concurrency = _Concurrency()

    async def admit(self, principal: Principal | None, reserve_tokens: int = 0) -> Hold:
        key = principal.key if principal else None
        if principal is None or key is None or not (key.rpm or key.tpm or key.max_concurrent):
            return Hold(None, None)
        await self._check_rates(principal.name, key)
        if key.max_concurrent and not self.concurrency.take(principal.name, key.max_concurrent):
            raise RateLimited(
                f"Key `{principal.name}` has {key.max_concurrent} requests in flight already.",
                retry_after_s=1.0,
            )
        return Hold(self, principal)

    async def _check_rates(self, name: str, key: ApiKey) -> None:
        try:
            if key.rpm and not await self.limiter.hit(RateLimitItemPerMinute(key.rpm), "rpm", name):
                raise RateLimited(
                    f"Key `{name}` is over its limit of {key.rpm} requests per minute.",
                    retry_after_s=await self._reset_in(key.rpm, "rpm", name),
                )
            if key.tpm and not await self.limiter.test(
                RateLimitItemPerMinute(key.tpm), "tpm", name
            ):
                raise RateLimited(
                    f"Key `{name}` is over its limit of {key.tpm} tokens per minute.",
                    retry_after_s=await self._reset_in(key.tpm, "tpm", name),
                )
        except RateLimited:
            raise
        except Exception as e:  # storage unreachable: fail open
            log.warning("rate-limit storage unavailable (%s); admitting", type(e).__name__)

    async def _reset_in(self, amount: int, kind: str, name: str) -> float:
        stats = await self.limiter.get_window_stats(RateLimitItemPerMinute(amount), kind, name)
        return max(1.0, stats.reset_time - time.time())

    async def in_use(self, name: str) -> int:
        """Concurrency slots key ``name`` holds now."""
        return self.concurrency._n.get(name, 0)

    async def done(self, principal: Principal, tokens: int) -> None:
        key = principal.key
        if key is None:
            return
        if key.max_concurrent:
            self.concurrency.give(principal.name)
        if key.tpm and tokens > 0:
            await self._spend(principal.name, key.tpm, tokens)

    async def _spend(self, name: str, tpm: int, tokens: int) -> None:
        item = RateLimitItemPerMinute(tpm)
        try:
            stats = await self.limiter.get_window_stats(item, "tpm", name)
            cost = min(tokens, max(stats.remaining, 0))
            if cost:
                await self.limiter.hit(item, "tpm", name, cost=cost)
        except Exception as e:
            log.warning("rate-limit storage unavailable (%s); tokens not counted", type(e).__name__)
