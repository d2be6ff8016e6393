"""``KeyLimits``: a request's per-key limits, taken at admission and settled when it ends.

The request path calls::

    hold = await key_limits.admit(principal, key_limits.reserve_for(prompt_tokens, max_tokens))
    try:
        ...  # send, relay
    finally:
        await hold.close(used_tokens)  # prompt + completion; None when unknown

``admit`` checks ``rpm``, then ``tpm`` (room for the request's worst case, which it reserves),
then ``max_concurrent``, and records all three at once or raises :class:`RateLimited` (429 with
``Retry-After``) having recorded nothing. ``close`` frees the concurrency slot and settles the
token reservation to the real usage (a refund, or a charge of the difference); with ``None`` the
reservation stands. ``close`` is idempotent and runs to completion even if its caller is
cancelled, so it belongs in a ``finally``.

With the Redis queue backend every replica shares one budget per key (``redis_store.py``):
concurrency slots are leases renewed while held, so a dead replica's slots come back within
``lease_ttl_s``. If Redis is unreachable (a failed call confirmed by a health probe) or refuses
(an error reply: full, read-only, ``MISCONF``…; no probe, a ``PING`` would still answer) the
limits fail open to this replica's own memory store (logged with the cause), and go back to
Redis once a renewal, which writes, succeeds. A renewal re-asserts the holds it names (so
they count again after a restarted Redis or a stall past the TTL); one given back while that
renewal was on its way (the give goes over another connection and may reach Redis first) is
released again right after it, so a request that ended never holds its slot until the lease
runs out. A hold whose give could not reach Redis is no longer counted here; it is given once
Redis takes writes again, and expires with its lease TTL meanwhile (it is no longer renewed).
Any other error reply (a script's error, ``WRONGTYPE`` on a key someone else wrote:
``StoreFailed``) fails only the request whose call it was, with a 503 and the traceback
logged; Redis stays in use. What a failed take wrote before its error is given back at once
(or expires: the hold with its lease TTL, the tokens with the window).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from gpupool.config.models import GpupoolConfig, QueueBackend
from gpupool.gateway.admission.connection import StoreFailed, StoreRefused, StoreUnavailable
from gpupool.gateway.errors import RateLimited, ServiceUnavailable
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits.base import Limit, LimitStore, Policy, Refusal, Usage
from gpupool.gateway.security.limits.memory import MemoryLimits
from gpupool.gateway.security.limits.redis_store import RedisLimits

log = logging.getLogger("gpupool.limits")

DEFAULT_RESERVE_TOKENS = 4096
ATTEMPTS = 3  # tries of a Redis call while the probe says Redis is up; then this replica's own
NO_LIMITS = Policy()
GiveArgs = tuple[str, Policy, str, int, int | None]  # LimitStore.give's arguments


class Hold:
    """One admitted request under a key; ``close(used_tokens)`` when it ends (idempotent)."""

    __slots__ = ("charge", "closed", "hold_id", "limits", "name", "policy", "store")

    def __init__(
        self,
        limits: KeyLimits | None = None,
        name: str = "",
        policy: Policy = NO_LIMITS,
        hold_id: str = "",
        charge: int = 0,
        store: LimitStore | None = None,
    ) -> None:
        self.limits = limits  # None: the key has no limits, closing does nothing
        self.name = name
        self.policy = policy
        self.hold_id = hold_id
        self.charge = charge  # tokens reserved
        self.store = store
        self.closed = False

    async def close(self, used_tokens: int | None) -> None:
        """Free the slot; settle the reservation to ``used_tokens`` (None: it stands)."""
        if self.closed or self.limits is None:
            return
        self.closed = True
        await self.limits.settle(self, used_tokens)


NO_HOLD = Hold()  # a request no key's limits count: closing it does nothing


class KeyLimits:
    """Per-key ``rpm``, ``tpm`` and ``max_concurrent``, in memory or shared through Redis."""

    def __init__(
        self,
        redis_url: str | None = None,
        prefix: str = "gpupool",
        *,
        lease_ttl_s: float = 10.0,
        default_reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
    ) -> None:
        self.default_reserve_tokens = default_reserve_tokens
        self._memory = MemoryLimits()
        self._redis = RedisLimits(redis_url, prefix, lease_ttl_s) if redis_url else None
        self._up = self._redis is not None
        self._held: dict[str, str] = {}  # hold id -> key name, for holds taken through Redis
        self._ids = itertools.count(1)
        self._token = secrets.token_hex(4)
        self._renewer: asyncio.Task[None] | None = None
        self._unsettled: dict[str, GiveArgs] = {}  # gives owed to Redis, by hold id
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, cfg: GpupoolConfig) -> KeyLimits:
        queue = cfg.queue
        return cls(
            queue.redis_url if queue.backend is QueueBackend.redis else None,
            queue.redis_prefix,
            lease_ttl_s=queue.lease_ttl_s,
            default_reserve_tokens=cfg.auth.tpm_reserve_tokens,
        )

    @property
    def redis_up(self) -> bool:
        return self._up

    def reserve_for(self, prompt_tokens: int, max_tokens: int | None, n: int = 1) -> int:
        """A request's worst case: its prompt (an upper bound, all prompts of a batch) plus
        ``n`` completions of ``max_tokens`` each (``auth.tpm_reserve_tokens`` when None; 0 for
        routes that generate nothing: embeddings, tokenize)."""
        completion = self.default_reserve_tokens if max_tokens is None else max_tokens
        return max(prompt_tokens, 0) + max(n, 1) * max(completion, 0)

    async def admit(self, principal: Principal | None, reserve_tokens: int = 0) -> Hold:
        """Admit a request under ``principal``'s key, reserving ``reserve_tokens`` of its tpm.

        Raises :class:`RateLimited` when a limit refuses it (nothing is recorded then).
        """
        key = principal.key if principal is not None else None
        if principal is None or key is None:
            return NO_HOLD
        policy = Policy.of(key)
        if not policy.active:
            return NO_HOLD
        hold_id = f"{self._token}-{next(self._ids)}"
        charge = policy.charge(reserve_tokens)
        store, refusal = await self._take(principal.name, policy, hold_id, charge)
        if refusal is not None:
            raise _refused(principal.name, policy, refusal, charge)
        return Hold(self, principal.name, policy, hold_id, charge, store)

    async def settle(self, hold: Hold, used_tokens: int | None) -> None:
        """Give ``hold`` back (see ``Hold.close``); finishes even if the caller is cancelled."""
        self._held.pop(hold.hold_id, None)
        await asyncio.shield(self._spawn(self._give(hold, used_tokens)))

    async def usage(self, name: str) -> Usage:
        """Holds, reserved tokens and the minute's counts of key ``name`` (all replicas)."""
        local = await self._memory.usage(name)
        if self._redis is None or not self._up:
            return local
        try:
            shared = await self._redis.usage(name)
        except StoreUnavailable as exc:  # this replica's own, as while Redis is down
            await self._suspect(exc)
            return local
        except StoreFailed as exc:
            log.exception("per-key limits: reading key %s's usage failed", name)
            raise ServiceUnavailable(f"Key `{name}`'s usage could not be read.") from exc
        return Usage(
            shared.in_use + local.in_use,
            shared.reserved + local.reserved,
            shared.tokens + local.tokens,
            shared.requests + local.requests,
        )

    def holders(self) -> set[str]:
        """The key names this replica's requests hold slots of now: with those of keys a
        reload removed, whose running requests still finish."""
        return self._memory.holders() | set(self._held.values())

    async def in_use(self, name: str) -> int:
        """Requests of key ``name`` holding a concurrency slot now, across replicas."""
        return (await self.usage(name)).in_use

    async def reserved(self, name: str) -> int:
        """Tokens reserved by the running requests of key ``name``, not yet settled."""
        return (await self.usage(name)).reserved

    async def aclose(self) -> None:
        # the flag too: a cancel landing while redis-py connects can be swallowed (Python 3.11)
        self._closing = True
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._redis is not None:
            await self._redis.aclose()

    # -- stores ---------------------------------------------------------------------------

    async def _take(
        self, name: str, policy: Policy, hold_id: str, charge: int
    ) -> tuple[LimitStore, Refusal | None]:
        for _ in range(ATTEMPTS):  # the script is idempotent: retried while Redis is up
            if self._redis is None or not self._up:
                break
            try:
                refusal = await self._redis.take(name, policy, hold_id, charge)
            except StoreUnavailable as exc:
                # the call may still land (a hung server wakes up): undone once Redis answers
                self._unsettled[hold_id] = (name, policy, hold_id, charge, 0)
                await self._suspect(exc)
                continue
            except StoreFailed as exc:
                # Redis rejected this call (a script's error, WRONGTYPE…) but is well: only
                # this request fails. What the script wrote before its error is given back.
                log.exception("per-key limits: a Redis call failed; this request fails")
                await asyncio.shield(self._spawn(self._undo((name, policy, hold_id, charge, 0))))
                raise ServiceUnavailable(
                    f"Key `{name}`'s limits could not be checked for this request; retry later."
                ) from exc
            self._unsettled.pop(hold_id, None)
            if refusal is None:
                self._held[hold_id] = name
                self._start_renewing()
            return self._redis, refusal
        if self._up:
            log.warning("per-key limits: Redis calls keep failing; admitting on local limits")
        return self._memory, await self._memory.take(name, policy, hold_id, charge)

    async def _give(self, hold: Hold, used: int | None) -> None:
        args = (hold.name, hold.policy, hold.hold_id, hold.charge, used)
        if hold.store is self._memory:
            await self._memory.give(*args)
            return
        redis = self._redis
        for _ in range(ATTEMPTS):  # idempotent too
            if redis is None or hold.store is not redis or not self._up:
                break
            try:
                await redis.give(*args)
                return
            except StoreUnavailable as exc:
                await self._suspect(exc)
            except StoreFailed:  # not renewed: the hold expires with its lease TTL
                log.exception("per-key limits: giving a hold back failed; it expires")
                return
        if redis is not None and hold.store is redis:  # settled once Redis answers again
            self._unsettled[hold.hold_id] = args

    async def _undo(self, args: GiveArgs) -> None:
        """Give back what a take that failed half way may have written (its hold, its tokens);
        what this give cannot undo expires: the hold with its lease TTL (never renewed), the
        tokens with the window."""
        assert self._redis is not None
        try:
            await self._redis.give(*args)
        except StoreUnavailable as exc:  # given once Redis answers again
            self._unsettled[args[2]] = args
            await self._suspect(exc)
        except StoreFailed as exc:
            log.warning("per-key limits: undoing a failed take failed too (%s); it expires", exc)

    async def _suspect(self, exc: BaseException) -> None:
        """A call failed: Redis is down if it refused (an error reply), or if the probe fails."""
        assert self._redis is not None
        refused = isinstance(exc, StoreRefused)
        if self._up and (refused or not await self._redis.probe.reachable()):
            self._up = False
            log.warning(
                "per-key limits: Redis %s (%s); failing open to this replica's own limits "
                "until it takes writes again",
                "refused a call" if refused else "unreachable",
                exc,
            )
            self._start_renewing()

    def _start_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def _renew_loop(self) -> None:
        assert self._redis is not None
        while not self._closing:
            await asyncio.sleep(self._redis.lease_ttl_s / 3)
            try:
                await self._renew_once(self._redis)
            except Exception:
                log.exception("per-key limits: renewal failed")

    async def _renew_once(self, redis: RedisLimits) -> None:
        if not self._up and not await redis.probe.reachable():
            return
        # the renewal writes (a heartbeat at least): back on Redis only once it succeeds, as a
        # full or read-only Redis still answers the probe's PING
        held = list(self._held.items())
        try:
            try:
                await redis.renew([(name, hold_id) for hold_id, name in held])
            finally:
                self._owe_releases(held)
            for hold_id, args in list(self._unsettled.items()):
                with contextlib.suppress(StoreFailed):  # a give Redis rejects: it expires
                    await redis.give(*args)
                if self._unsettled.get(hold_id) is args:  # not owed anew meanwhile
                    del self._unsettled[hold_id]
        except StoreUnavailable as exc:
            await self._suspect(exc)
            return
        if not self._up:
            self._up = True
            log.info("per-key limits: Redis takes writes again; limits shared again")

    def _owe_releases(self, renewed: list[tuple[str, str]]) -> None:
        """Holds given back while a renewal naming them was on its way: it may have reached
        Redis after the give (another connection) and re-asserted the hold, which would then
        count until its lease expired. Each is released again (its slot only: its own give
        settled its tokens) right after the renewal, by the loop over ``_unsettled``."""
        for hold_id, name in renewed:
            if hold_id not in self._held:
                self._unsettled.setdefault(hold_id, (name, NO_LIMITS, hold_id, 0, None))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _refused(name: str, policy: Policy, refusal: Refusal, charge: int) -> RateLimited:
    wait = max(1.0, refusal.retry_after_s)
    if refusal.limit is Limit.rpm:
        message = f"Key `{name}` is over its limit of {policy.rpm} requests per minute."
    elif refusal.limit is Limit.tpm:
        message = (
            f"Key `{name}` is over its limit of {policy.tpm} tokens per minute "
            f"(this request reserves {max(charge, 1)})."
        )
    else:
        message = f"Key `{name}` has {refusal.in_flight} requests in flight already."
    return RateLimited(message, retry_after_s=wait)


async def close_after(
    stream: AsyncIterator[bytes], hold: Hold, tokens: list[int]
) -> AsyncIterator[bytes]:
    """Pass a stream through, closing the hold when it ends however it ends."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        await hold.close(sum(tokens))
