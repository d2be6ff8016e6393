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
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from gpupool.config.models import QueueBackend, QueueConfig, TenancyConfig
from gpupool.gateway.admission.connection import CONNECTION_ERRORS, redis_client

log = logging.getLogger("gpupool.tenancy")


@dataclass(frozen=True, slots=True)
class Owner:
    worker: str
    tenant: str


class Owners(Protocol):
    async def remember(self, response_id: str, owner: Owner) -> None: ...

    async def find(self, response_id: str) -> Owner | None: ...

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
    """In Redis (``<prefix>:resp:<id>`` = ``worker NUL tenant``, with the TTL)."""

    def __init__(self, redis: Redis, prefix: str, ttl_s: float, limit: int) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.local = MemoryOwners(ttl_s, limit)

    def _key(self, response_id: str) -> str:
        return f"{self.prefix}:resp:{response_id}"

    async def remember(self, response_id: str, owner: Owner) -> None:
        self.local.put(response_id, owner)
        try:
            await self.redis.set(self._key(response_id), f"{owner.worker}\0{owner.tenant}",
                                 px=self.ttl_ms)  # fmt: skip
        except CONNECTION_ERRORS as e:
            log.warning("stored response %s: not written to Redis (%s)", response_id, e)

    async def find(self, response_id: str) -> Owner | None:
        mine = self.local.get(response_id)
        if mine is not None:
            return mine
        try:
            value = await self.redis.get(self._key(response_id))
        except CONNECTION_ERRORS as e:
            log.warning("stored response %s: Redis unreachable (%s)", response_id, e)
            return None
        if not isinstance(value, str) or "\0" not in value:
            return None
        worker, _, tenant = value.partition("\0")
        return Owner(worker, tenant)

    async def forget(self, response_id: str) -> None:
        await self.local.forget(response_id)
        try:
            await self.redis.delete(self._key(response_id))
        except CONNECTION_ERRORS as e:
            log.warning("stored response %s: not removed from Redis (%s)", response_id, e)

    async def aclose(self) -> None:
        await self.redis.aclose()


def build_owners(tenancy: TenancyConfig, queue: QueueConfig) -> Owners:
    """The store the queue's backend implies: Redis when admission shares Redis, else memory."""
    ttl, limit = tenancy.stored_response_ttl_s, tenancy.max_stored_responses
    if queue.backend is QueueBackend.redis:
        client = redis_client(queue.redis_url, queue.lease_ttl_s, max_connections=16)
        return RedisOwners(client, queue.redis_prefix, ttl, limit)
    return MemoryOwners(ttl, limit)
