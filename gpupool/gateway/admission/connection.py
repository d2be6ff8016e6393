"""Redis connections for shared state: a request pool that waits, and a health probe.

Two clients per user of Redis (admission, per-key limits):

* the **request pool** carries the calls of the request path. It is bounded and blocking with no
  pool timeout: under a burst a call waits for a connection instead of failing, so load can
  never look like an outage. Each call is still bounded by the socket timeouts, so a hung
  server frees the connections it holds.
* the **control client** (a couple of connections of its own) carries the heartbeat, lease
  renewal, pub/sub and the health probe, so a burst queued on the request pool cannot delay a
  renewal past the lease TTL.

A failed call on the request pool is only a *suspicion*: :class:`Probe` then pings Redis over
the control client (one probe at a time, shared by every caller that suspects), and only a
failed ping (refused, reset, or no answer within the socket timeout) declares Redis down.

An error *reply* about the server's state is different: Redis answered and said no to every
write alike (``OOM`` when full with ``noeviction``, ``READONLY`` on a replica, ``MISCONF``,
``MASTERDOWN``, ``NOREPLICAS``, ``BUSY``, ``LOADING``, ``CLUSTERDOWN``, ``TRYAGAIN``). A ``PING``
still answers then, so probing would call Redis up and every request would fail again: such a
failure is :class:`StoreRefused`, which callers treat as an outage at once.

Any other error reply is about the call itself: a script's bug, ``WRONGTYPE`` on a key someone
else wrote, an argument a request made invalid (or a call redis-py could not make). Redis is as
well as before, so it is :class:`StoreFailed`, deliberately no ``StoreUnavailable``: the one
request fails (a 503 in its route's shape, logged with the traceback), nothing goes into outage
mode. Every Redis failure reaches callers through :func:`store_error`, as one of these three,
naming its cause. ``NOSCRIPT`` never reaches them: redis-py's ``Script`` objects
(``register_script``) load the script again and retry.

    StoreUnavailable   unreachable: connection refused, reset, timed out (the probe decides)
    └── StoreRefused   a server-state error reply (no probe: down now)
    StoreFailed        any other error reply: this call failed, Redis is not down
"""

from __future__ import annotations

import asyncio

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
# Every failure of a Redis call: redis-py's errors (the connection's, and the server's error
# replies) and the socket's own. ``store_error`` sorts them.
REDIS_FAILURES = (RedisError, OSError)
# Error replies about the server's state, not the call: every write fails alike until it
# changes. redis-py's own classes where it has one (MASTERDOWN is a ClusterDownError; LOADING's
# BusyLoadingError is a ConnectionError, so it is checked first), the reply's first word
# otherwise (a plain ResponseError keeps it: "MISCONF ...").
STATE_ERRORS = (OutOfMemoryError, ReadOnlyError, BusyLoadingError, ClusterDownError, TryAgainError)
STATE_REPLIES = frozenset(
    {"OOM", "READONLY", "MISCONF", "MASTERDOWN", "NOREPLICAS", "BUSY", "LOADING", "CLUSTERDOWN",
     "TRYAGAIN"}
)  # fmt: skip
CONTROL_CONNECTIONS = 3  # pub/sub listener, maintenance, probe


class StoreUnavailable(Exception):
    """Redis could not be reached (refused, reset, timed out). Deliberately not an OSError, so
    a caller can tell it from its own I/O errors (a client that went away)."""


class StoreRefused(StoreUnavailable):
    """Redis answered with an error about its state (full, read-only, ``MISCONF``…): a ``PING``
    proves nothing, so this is an outage as it stands, without a probe. It ends when a write
    succeeds again (each backend's recovery writes before going back)."""


class StoreFailed(Exception):
    """Redis rejected this one call (a script's error, ``WRONGTYPE``, a bad argument) while
    being well: the request that made it fails, Redis is not marked down. Not a
    ``StoreUnavailable``, so no outage handler can take it for one."""


def store_error(exc: BaseException) -> StoreUnavailable | StoreFailed:
    """A failed Redis call (one of ``REDIS_FAILURES``) as callers handle it, with its cause."""
    cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if is_state_reply(exc):
        return StoreRefused(cause)
    if isinstance(exc, CONNECTION_ERRORS):
        return StoreUnavailable(cause)
    return StoreFailed(cause)


def is_state_reply(exc: BaseException) -> bool:
    """Is ``exc`` an error reply about the server's state (an outage), not about the call?"""
    if isinstance(exc, STATE_ERRORS):
        return True
    words = str(exc).split(maxsplit=1) if isinstance(exc, ResponseError) else []
    return bool(words) and words[0] in STATE_REPLIES


def socket_timeout_s(lease_ttl_s: float) -> float:
    """Seconds one call may take: about half a lease TTL, within [1, 5]."""
    return max(1.0, min(5.0, lease_ttl_s / 2))


def redis_client(url: str, lease_ttl_s: float, max_connections: int = 64) -> Redis:
    """A client that fails fast on a dead server and waits (never fails) on a busy pool.

    One immediate retry covers a stale pooled socket after a Redis restart; the socket timeouts
    make an outage visible within about ``lease_ttl_s / 2``.
    """
    timeout = socket_timeout_s(lease_ttl_s)
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,  # wait for a free connection as long as it takes
        decode_responses=True,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1),
    )
    return Redis.from_pool(pool)


class Probe:
    """Is Redis reachable? One ``PING`` at a time over the control client, shared by callers."""

    def __init__(self, control: Redis) -> None:
        self._control = control
        self._running: asyncio.Task[bool] | None = None

    async def reachable(self) -> bool:
        """True when Redis answers a ``PING`` (concurrent callers share one probe)."""
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(self._ping())
        return await asyncio.shield(self._running)

    async def _ping(self) -> bool:
        try:
            await self._control.ping()
        except REDIS_FAILURES:  # an error reply too (a replica cut off: MASTERDOWN)
            return False
        return True
