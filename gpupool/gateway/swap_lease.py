"""One gateway controls a swap group, however many replicas share a Redis backend.

Two gateways that both put a group's workers to sleep and wake them fight: each wakes its
choice beside the other's (issue 37 saw 36 ledger violations in 30 s, two replicas on one
``url:`` group). With ``queue.backend: redis`` every replica with swap groups claims each group
in Redis before it starts them: a key ``{prefix}:swap:{group}:{members}`` (the members named by
what they are: a ``url:`` worker's URL, a launched one's host and GPUs) set to the replica's id
with ``NX`` and a TTL of ``3 x queue.lease_ttl_s``, renewed every ``lease_ttl_s`` while it
serves and deleted when it stops.

A replica that finds a group held by another *stands by*: its start waits (it serves nothing,
its ``/ready`` never answers) and reads the claim every ``lease_ttl_s``, saying once which
group and whose. It takes the claim only once it has been gone for one and a half renew periods
(a live holder renews within one: after Redis restarts empty it takes its claim back first), so
a holder that dies (or is stopped) is replaced about ``TTL + 1.5 x lease_ttl_s`` after its last
renewal; the standby then starts as a replica started then would (its groups read the ``url:``
members' ``/is_sleeping``: the first awake keeps the GPU). A standby asked to stop (SIGTERM)
stops waiting and exits.

The holder *fences* itself: a group acts (a switch, an idle sleep) only while its claim was
renewed within ``TTL - lease_ttl_s`` (``fresh``), so a holder cut off from Redis, or frozen,
stops acting before its claim can lapse and another replica take it. A claim found taken by
another at a renewal (its key lapsed and a standby took it) stops this replica's groups at once,
every one (it releases the rest: the standby takes all or none), ``on_lost``: its ``url:``
members are marked failed there, naming the other; logged as an error. What fencing cannot
undo: a sleep or wake call already sent when the claim went stale. With the memory backend
there is no claim (one gateway, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
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
        self.stopping: Callable[[], bool] = lambda: False  # serve's SIGTERM, for a standby
        self._fresh_until = 0.0  # (monotonic) our claims cannot have lapsed before this
        self._lost: set[str] = set()  # groups another replica took from this one
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, cfg: GpupoolConfig, replica: str) -> SwapLeases | None:
        """None without Redis or without swap groups: nothing to share."""
        keys = group_keys(cfg)
        if cfg.queue.backend is not QueueBackend.redis or not keys:
            return None
        client = redis_client(cfg.queue.redis_url, cfg.queue.lease_ttl_s, max_connections=2)
        return cls(client, keys, replica, cfg.queue.lease_ttl_s)

    def fresh(self) -> bool:
        """Whether this replica may act on its groups: every claim renewed recently enough
        that none can have lapsed (it lapses a TTL after its renewal; this says no one renew
        period before)."""
        return time.monotonic() < self._fresh_until

    def _renewed(self, at: float) -> None:
        self._fresh_until = at + self.ttl_ms / 1000 - self.every_s

    async def claim(self) -> None:
        """Take every group: at once when none is held, else once the holder's claims have
        lapsed (stand by meanwhile). ``SwapControllerTaken`` when asked to stop meanwhile."""
        standby = False
        while True:
            t0 = time.monotonic()
            try:
                held = await self._take_all(confirm=standby)
            except (*CONNECTION_ERRORS, RedisError) as e:
                if not standby:
                    raise  # (at start, as before: serve fails, saying why)
                log.warning("standing by: the swap groups' claims cannot be read (%s)", e)
                await self._wait()
                continue
            if held is None:
                self._renewed(t0)
                if standby:
                    log.warning("swap groups %s: the other replica's claim lapsed; this "
                                "replica controls them now", ", ".join(self.keys))  # fmt: skip
                return
            group, holder = held
            if not standby:
                log.warning(
                    "swap group `%s` is controlled by another gateway replica (%s) on this "
                    "Redis: this one stands by (serving nothing) until that claim lapses "
                    "(%g s after its last renewal)", group, holder, self.ttl_ms / 1000,
                )  # fmt: skip
                standby = True
            await self._wait()

    async def _wait(self) -> None:
        """One renew period of standing by; ``SwapControllerTaken`` once asked to stop."""
        if self.stopping():
            raise SwapControllerTaken("stopped while standing by for a swap group's claim")
        await asyncio.sleep(self.every_s)

    async def _take_all(self, confirm: bool) -> tuple[str, str] | None:
        """Take every key (None), or take none and say which group another holds and whose."""
        taken: list[str] = []
        try:
            for group, key in self.keys.items():
                holder = await self._take(key, confirm)
                if holder is not None:
                    await self._release(taken)
                    return group, holder
                taken.append(key)
        except BaseException:
            await self._release(taken)
            raise
        return None

    async def _take(self, key: str, confirm: bool) -> str | None:
        """None once ``key`` is ours; else its holder's id. With ``confirm`` (another held it),
        a key found gone is taken only if still gone 1.5 renew periods later: a live holder
        renews within one (Redis restarted empty), a dead one does not."""
        if confirm and await self.client.get(key) is None:
            await asyncio.sleep(self.every_s * 1.5)
        if await self.client.set(key, self.replica, nx=True, px=self.ttl_ms):
            return None
        found = await self.client.get(key)  # (a str: the client decodes)
        if found == self.replica:
            return None
        return found if isinstance(found, str) else repr(found)

    def start(self, on_lost: Callable[[str, str], Awaitable[None]]) -> None:
        self._task = asyncio.create_task(self._renew(on_lost), name="gpupool-swap-leases")

    async def _renew(self, on_lost: Callable[[str, str], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            t0, renewed = time.monotonic(), True
            for group, key in self.keys.items():
                if group in self._lost:
                    renewed = False
                    continue
                try:
                    other = await self.client.eval(_RENEW, 1, key, self.replica, self.ttl_ms)
                except (*CONNECTION_ERRORS, RedisError) as e:
                    log.warning("swap group %s: its claim could not be renewed (%s)", group, e)
                    renewed = False
                    continue
                if other:
                    log.error("swap group %s: now controlled by replica %s; this one stops "
                              "controlling it", group, other)  # fmt: skip
                    await self._lose_all(str(other), on_lost)
                    return
            if renewed:
                self._renewed(t0)

    async def _lose_all(self, holder: str, on_lost: Callable[[str, str], Awaitable[None]]) -> None:
        """One group taken by another gives up every group: a standby takes all or none
        (``claim``), so one kept here would leave it standing by, and this replica fenced
        (never renewed whole again), with no one switching any group."""
        self._fresh_until = 0.0  # no group acts from now on
        with contextlib.suppress(*CONNECTION_ERRORS, RedisError):
            await self._release([k for g, k in self.keys.items() if g not in self._lost])
        for group in self.keys:
            if group not in self._lost:
                self._lost.add(group)
                await on_lost(group, holder)

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
