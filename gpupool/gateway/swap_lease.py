"""One gateway controls a swap group, however many replicas share a Redis backend.

Two gateways that both put a group's workers to sleep and wake them fight: each wakes its
choice beside the other's (issue 37 saw 36 ledger violations in 30 s, two replicas on one
``url:`` group). With ``queue.backend: redis`` every replica with swap groups claims each group
in Redis before it starts them: a key ``{prefix}:swap:{group}:{members}`` (the members named by
what they are: a ``url:`` worker's URL, a launched one's host and GPUs) set to the replica's id
with ``NX`` and a TTL of ``3 x queue.lease_ttl_s``, renewed every ``lease_ttl_s`` while it
serves and deleted when it stops. A replica that finds a group held by another refuses to serve
(``SwapControllerTaken``: ``gpupool serve`` exits saying which group and whose), rather than
follow: one controller, the others do not start. If the holder dies, its claim lapses after the
TTL and a replica started then takes it.

A claim lost while serving (Redis flushed, or its key expired through a long outage and another
replica took it) stops this replica's groups at once (``on_lost``), logged as an error: the
other controls them. With the memory backend there is no claim (one gateway, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gpupool.config.models import GpupoolConfig, QueueBackend, WorkerConfig
from gpupool.gateway.admission.connection import CONNECTION_ERRORS, redis_client

log = logging.getLogger("gpupool.swap")

# renew: still ours → extend; gone → take again; another's → its id
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return '' end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return '' end
return v
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SwapControllerTaken(RuntimeError):
    """Another replica controls a swap group of this configuration."""


def group_keys(cfg: GpupoolConfig) -> dict[str, str]:
    """Each swap group's Redis key, named by its members (same workers: same key)."""
    members: dict[str, list[str]] = {}
    host = socket.gethostname()
    for wc in cfg.workers:
        if wc.swap_group is None and wc.sleep is None:
            continue
        members.setdefault(wc.swap_group or wc.name, []).append(_identity(wc, host))
    out = {}
    for group, ids in members.items():
        digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:16]
        out[group] = f"{cfg.queue.redis_prefix}:swap:{group}:{digest}"
    return out


def _identity(wc: WorkerConfig, host: str) -> str:
    if wc.url is not None:
        return wc.url
    gpus = ",".join(map(str, wc.launch.gpus or [])) if wc.launch else ""
    return f"{host}:gpu{gpus}"


class SwapLeases:
    def __init__(self, client: Redis, keys: dict[str, str], replica: str, ttl_s: float) -> None:
        self.client = client
        self.keys = keys
        self.replica = replica
        self.ttl_ms = int(ttl_s * 3000)
        self.every_s = ttl_s
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, cfg: GpupoolConfig, replica: str) -> SwapLeases | None:
        """None without Redis or without swap groups: nothing to share."""
        keys = group_keys(cfg)
        if cfg.queue.backend is not QueueBackend.redis or not keys:
            return None
        client = redis_client(cfg.queue.redis_url, cfg.queue.lease_ttl_s, max_connections=2)
        return cls(client, keys, replica, cfg.queue.lease_ttl_s)

    async def claim(self) -> None:
        """Take every group, or none: raise ``SwapControllerTaken`` naming a holder."""
        taken: list[str] = []
        try:
            for group, key in self.keys.items():
                if await self.client.set(key, self.replica, nx=True, px=self.ttl_ms):
                    taken.append(key)
                    continue
                found = await self.client.get(key)  # (a str: the client decodes)
                holder = found if isinstance(found, str) else repr(found)
                if holder == self.replica:
                    continue
                raise SwapControllerTaken(
                    f"swap group `{group}` is controlled by another gateway replica ({holder}) "
                    "on this Redis: two controllers would wake its models beside each other. "
                    "Serve sleep-mode workers from one replica (its claim lapses "
                    f"{self.ttl_ms / 1000:g} s after it stops)"
                )
        except BaseException:
            await self._release(taken)
            raise

    def start(self, on_lost: Callable[[str], Awaitable[None]]) -> None:
        self._task = asyncio.create_task(self._renew(on_lost), name="gpupool-swap-leases")

    async def _renew(self, on_lost: Callable[[str], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            for group, key in self.keys.items():
                try:
                    other = await self.client.eval(_RENEW, 1, key, self.replica, self.ttl_ms)
                except (*CONNECTION_ERRORS, RedisError) as e:
                    log.warning("swap group %s: its claim could not be renewed (%s)", group, e)
                    continue
                if other:
                    log.error("swap group %s: now controlled by replica %s; this one stops "
                              "controlling it", group, other)  # fmt: skip
                    await on_lost(group)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(*CONNECTION_ERRORS, RedisError):
            await self._release(list(self.keys.values()))
        await self.client.aclose()

    async def _release(self, keys: Sequence[str]) -> None:
        for key in keys:
            await self.client.eval(_RELEASE, 1, key, self.replica)
