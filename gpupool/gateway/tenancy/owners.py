"""Which worker and tenant made each stored ``/v1/responses`` response.

vLLM keeps a stored response in the memory of the worker that made it: ``previous_response_id``,
``GET /v1/responses/{id}`` and its ``cancel`` only work there, and vLLM knows nothing of
tenants. The gateway remembers ``id → (worker, tenant)`` when the worker accepts the request,
routes every later use of the id to that worker, and answers another tenant's use of it with
the 404 vLLM gives for an unknown id.

Two backends, one interface (:class:`Owners`): :class:`MemoryOwners` (one gateway; bounded,
oldest forgotten first) and :class:`RedisOwners` (replicas share it; a key per response with
the TTL). The Redis backend keeps a memory copy of what this replica wrote, so its own
follow-ups still find their worker while Redis is unreachable.

Every Redis call is bounded as a whole (a pooled connection, the client's retry and the answer)
by the socket timeout the gateway gives every Redis call (``admission/connection.py``). Any
failure (unreachable, no answer in time, or refused: a read-only replica, ``OOM``,
``MASTERDOWN``) is logged; a write that failed is left to the memory copy (the answer is already
made: failing the request would lose it), and a lookup that failed raises
:class:`~gpupool.gateway.admission.connection.StoreUnavailable` (a 503, ``pipeline/stored.py``):
nobody can say whether the response exists, so not a 404.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gpupool.config.models import QueueBackend, QueueConfig, TenancyConfig
from gpupool.gateway.admission.connection import StoreUnavailable, redis_client, socket_timeout_s

log = logging.getLogger("gpupool.tenancy")
T = TypeVar("T")
# What a Redis call may fail with: redis-py's errors (connection, timeout, and the server's
# refusals: READONLY, OOM, MASTERDOWN…), the socket's own, and the call's deadline.
_FAILURES = (RedisError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Owner:
    worker: str
    tenant: str
    # the create's answer began in reasoning (its ``enable_thinking``): how a ``GET`` of it is
    # split again when the gateway splits the model's reasoning (``pipeline/stored.py``)
    thinking: bool = True


class Owners(Protocol):
    async def remember(self, response_id: str, owner: Owner) -> None: ...

    async def find(self, response_id: str) -> Owner | None:
        """The owner, None when unknown; ``StoreUnavailable`` when the store cannot tell."""
        ...

    async def forget(self, response_id: str) -> None: ...

    async def aclose(self) -> None: ...


class MemoryOwners:
    """In this process: at most ``limit`` responses, each for ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float, limit: int) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._items: OrderedDict[str, tuple[float, Owner]] = OrderedDict()

    async def remember(self, response_id: str, owner: Owner) -> None:
        self.put(response_id, owner)

    def put(self, response_id: str, owner: Owner) -> None:
        items = self._items
        items[response_id] = (time.monotonic() + self.ttl_s, owner)
        items.move_to_end(response_id)
        while len(items) > self.limit:
            items.popitem(last=False)

    async def find(self, response_id: str) -> Owner | None:
        return self.get(response_id)

    def get(self, response_id: str) -> Owner | None:
        found = self._items.get(response_id)
        if found is None:
            return None
        if found[0] < time.monotonic():
            del self._items[response_id]
            return None
        return found[1]

    async def forget(self, response_id: str) -> None:
        self._items.pop(response_id, None)

    async def aclose(self) -> None:
        self._items.clear()


class RedisOwners:
    """In Redis (``<prefix>:resp:<id>`` = ``worker NUL tenant NUL 1|0`` (``thinking``; a value
    without it reads as 1), with the TTL); each call within ``timeout_s`` in all."""

    def __init__(
        self, redis: Redis, prefix: str, ttl_s: float, limit: int, timeout_s: float = 5.0
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.local = MemoryOwners(ttl_s, limit)

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}:resp:{response_id}"

    async def _call(self, call: Awaitable[T]) -> T:
        """``call`` within ``timeout_s`` (also while it waits for a pooled connection, which
        the socket timeouts alone do not bound); any failure as ``StoreUnavailable``."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except _FAILURES as e:
            why = str(e) or f"no answer within {self.timeout_s:g}s"
            raise StoreUnavailable(f"{type(e).__name__}: {why}") from e

    async def remember(self, response_id: str, owner: Owner) -> None:
        self.local.put(response_id, owner)
        value = f"{owner.worker}\0{owner.tenant}\0{int(owner.thinking)}"
        try:
            await self._call(self.redis.set(self._key(response_id), value, px=self.ttl_ms))
        except StoreUnavailable as e:
            log.warning("stored response %s: not written to Redis, so only this replica will "
                        "find it (%s)", response_id, e)  # fmt: skip

    async def find(self, response_id: str) -> Owner | None:
        mine = self.local.get(response_id)
        if mine is not None:
            return mine
        try:
            value = await self._call(self.redis.get(self._key(response_id)))
        except StoreUnavailable as e:
            log.warning("stored response %s: not looked up, Redis failed (%s)", response_id, e)
            raise
        if not isinstance(value, str) or "\0" not in value:
            return None
        worker, _, rest = value.partition("\0")
        tenant, _, thinking = rest.partition("\0")
        return Owner(worker, tenant, thinking != "0")

    async def forget(self, response_id: str) -> None:
        await self.local.forget(response_id)
        try:
            await self._call(self.redis.delete(self._key(response_id)))
        except StoreUnavailable as e:  # its key expires with the TTL; the worker's is gone
            log.warning("stored response %s: not removed from Redis (%s)", response_id, e)

    async def aclose(self) -> None:
        await self.redis.aclose()


def build_owners(tenancy: TenancyConfig, queue: QueueConfig) -> Owners:
    """The store the queue's backend implies: Redis when admission shares Redis, else memory."""
    ttl, limit = tenancy.stored_response_ttl_s, tenancy.max_stored_responses
    if queue.backend is QueueBackend.redis:
        client = redis_client(queue.redis_url, queue.lease_ttl_s, max_connections=16)
        timeout = socket_timeout_s(queue.lease_ttl_s)  # as every Redis call of the gateway
        return RedisOwners(client, queue.redis_prefix, ttl, limit, timeout)
    return MemoryOwners(ttl, limit)
