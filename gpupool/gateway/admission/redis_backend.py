"""Redis admission: gateway replicas share worker slots and one fair queue per model.

Key names: ``keys.py``. Atomic operations: the Lua scripts in ``redis_scripts.py``. This module
is one replica's side: its waiters, its leases, and three background duties.

Slots are leases. A grant adds the admission id to ``s:<worker>`` scored by its expiry (now +
``lease_ttl_s``); this replica re-asserts every lease it holds every ``lease_ttl_s / 3`` together
with its heartbeat (``renew``). A replica that dies stops renewing, so its slots come back within
the TTL and its waiting tickets are skipped by ``dispatch`` and swept by the next ``renew`` of any
replica once its heartbeat expires.

Wake-up path. Every script that frees a slot or adds a waiter ends in ``dispatch``, which grants
the slot to the head of ``w:<worker>`` inside the same atomic step and publishes
``"<iid> <worker>"`` on the owning replica's ``wake:<replica>`` channel. The owner's listener
resolves the waiting future (a replica that released the slot itself wakes its own waiter from
the script's reply at once). Safety net for a lost message or a slot freed by expiry: every
``recheck_interval_s`` (default ``min(0.5, lease_ttl_s / 4)``) the replica runs ``recheck`` for its
waiters: it dispatches all their candidate workers with this replica's view of capacity and
reports each ticket's state (granted, waiting, or gone: a gone ticket is queued again).

Cancellation. A waiter that leaves without a lease (cancelled, or its ``on_wait`` failed) runs
``withdraw`` to completion (shielded): if the ticket was granted meanwhile, the slot is released
at once rather than left to expire.

Outage. Calls of the request path go through a bounded pool that waits for a free connection
(``connection.py``), so a burst is never an outage. A failed call (refused, reset, timed out) is
only a suspicion: Redis is marked down when the health probe, a ``PING`` over the control
client, fails too; otherwise the call is retried (every script is idempotent). A call Redis
refused with an error reply about its state (``OOM`` when full, ``READONLY`` on a replica,
``MISCONF``…) marks it down at once: the probe's ``PING`` would still answer. Any other error
reply (a script's error, ``WRONGTYPE`` on a key someone else wrote: ``StoreFailed``) fails only
the request that made the call, with a 503 and the traceback logged; Redis stays in use, and what
the call wrote before failing is withdrawn (or left to the lease TTL and the renewal's sweep).
Heartbeat, renewal, re-check and pub/sub use that control client, never the request pool, so a
burst waiting for connections cannot delay a renewal past the TTL. Policy ``reject``: new and
waiting requests get ``ServiceUnavailable`` (503, ``Retry-After`` one renewal interval). Policy
``local``: they are served by a :class:`MemoryAdmission` over this replica's share of each worker
(``capacity // replicas_hint``, at least 1); the leases this replica already holds through
Redis are counted in that share (``force_hold``), so the replica does not exceed its share by the
requests it was already running. Releases during the outage are local only. The maintenance loop
pings Redis every ``recheck_interval_s``; when it answers and takes the renewal (a write, the
heartbeat first, which a full or read-only Redis refuses), the replica re-asserts every lease it
still holds, Redis-granted or local, as a Redis lease (Redis then counts the work really running,
possibly above capacity for a moment: it grants nothing on that worker until the count drops
below), drops its stale tickets, switches new requests back to Redis and moves its local waiters
back to the Redis queue (with their remaining wait). Nothing restarts and nothing leaks: a lease
is either re-asserted while held or, if its release could not reach Redis (or Redis refused it),
expires with its TTL (or vanished with a restarted Redis).

Limits. Capacity is exact while Redis is up. At the moment of failover, a replica holding less
than its share may add local work on top of the other replicas' Redis leases (by at most its
unused share); during the outage each replica stays within its share. A replica stalled for
longer than ``lease_ttl_s`` loses its leases to others until its next renewal re-asserts them.
Capacity and availability are each replica's own view, passed into every script.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from redis.asyncio import Redis

from gpupool.config.models import QueueConfig, RedisFailurePolicy
from gpupool.gateway.admission.base import LIVE_QUEUE, Lease, Ticket, WaitCallback, WorkerView
from gpupool.gateway.admission.connection import (
    CONTROL_CONNECTIONS,
    REDIS_FAILURES,
    Probe,
    StoreFailed,
    StoreRefused,
    StoreUnavailable,
    redis_client,
)
from gpupool.gateway.admission.fairness import retry_after
from gpupool.gateway.admission.keys import Keys
from gpupool.gateway.admission.memory import (
    MemoryAdmission,
    Requeued,
    tenant_full_message,
    unique,
)
from gpupool.gateway.admission.redis_scripts import Caps, Store
from gpupool.gateway.admission.waiting import consume, wait_for_grant
from gpupool.gateway.errors import QueueFull, QueueTimeout, ServiceUnavailable

log = logging.getLogger(__name__)


ATTEMPTS = 3  # tries of a release or withdrawal while the probe says Redis is up


class RedisDown(Exception):
    """Redis could not be reached while serving an acquire; it is retried locally."""


class ShareView:
    """This replica's share of every worker: ``capacity // replicas``, at least 1."""

    def __init__(self, workers: WorkerView, replicas: int) -> None:
        self._workers = workers
        self._replicas = max(1, replicas)

    def capacity(self, worker: str) -> int:
        return max(1, self._workers.capacity(worker) // self._replicas)

    def available(self, worker: str) -> bool:
        return self._workers.available(worker)

    def slots(self, worker: str) -> int:
        return self.capacity(worker) if self._workers.available(worker) else 0


@dataclass(eq=False, slots=True)
class _Waiter:
    iid: str
    ticket: Ticket
    fut: asyncio.Future[str]
    began: float
    key: str = ""  # order key, set once the ticket is queued in Redis


@dataclass(slots=True)
class _Held:
    worker: str
    tenant: str
    local: Lease | None = None  # also counted by the local fallback


class RedisAdmission:
    """The ``Admission`` contract shared through Redis by several gateway replicas."""

    def __init__(
        self,
        cfg: QueueConfig,
        workers: WorkerView,
        *,
        replica_id: str,
        recheck_interval_s: float | None = None,
        client: Redis | None = None,
        control: Redis | None = None,
    ) -> None:
        self._cfg = cfg
        self._workers = workers
        self.replica_id = replica_id
        self._recheck_s = recheck_interval_s or min(0.5, cfg.lease_ttl_s / 4)
        self._renew_s = cfg.lease_ttl_s / 3
        self._keys = Keys(cfg.redis_prefix)
        self._client = client or redis_client(cfg.redis_url, cfg.lease_ttl_s)
        self._control = control or redis_client(
            cfg.redis_url, cfg.lease_ttl_s, max_connections=CONTROL_CONNECTIONS
        )
        self._store = Store(self._client, cfg)
        self._ctl = Store(self._control, cfg)
        self._probe = Probe(self._control)
        self._local = MemoryAdmission.from_config(
            cfg, ShareView(workers, cfg.replicas_hint), replica_id
        )
        self._up = False
        self._waiting: dict[str, _Waiter] = {}
        self._held: dict[str, _Held] = {}
        self._doubtful: set[str] = set()  # tickets whose last call failed: withdrawn on recovery
        self._renewing: list[tuple[str, str]] | None = None  # releases during a renew call
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()  # every background task, for references
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def redis_up(self) -> bool:
        return self._up

    # -- lifecycle ------------------------------------------------------------------------

    def configure(self, cfg: QueueConfig) -> None:
        """A reload's queue settings for this replica's calls (each replica passes its own to
        the scripts: reload every replica). Connection settings stay as they started."""
        live = {name: getattr(cfg, name) for name in LIVE_QUEUE}
        self._cfg = self._cfg.model_copy(update=live)
        self._store = Store(self._client, self._cfg)
        self._ctl = Store(self._control, self._cfg)
        self._local.configure(self._cfg)

    async def start(self) -> None:
        try:
            await self._recover()
        except StoreUnavailable as exc:
            log.warning("admission: Redis unavailable at start (%s); policy %s", exc, self._policy)
        except StoreFailed:  # retried by the maintenance loop, as an outage at start
            log.exception("admission: a Redis call failed at start; policy %s", self._policy)
        self._loops = [self._spawn(self._listen()), self._spawn(self._maintain())]

    async def close(self) -> None:
        # The loops also stop on the flag: on Python 3.11 a cancel that lands while redis-py
        # opens a connection can be swallowed (asyncio.wait_for), so cancel alone may not do.
        self._closing = True
        for task in self._loops:
            task.cancel()
        if self._tasks:  # the loops, and releases or withdrawals still on their way
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for waiter in self._waiting.values():
            if not waiter.fut.done():
                waiter.fut.set_exception(ServiceUnavailable("The gateway is shutting down."))
        await self._local.close()
        if self._up:
            with contextlib.suppress(StoreUnavailable, StoreFailed):
                await self._ctl.retire(self.replica_id)
        await self._client.aclose()
        await self._control.aclose()

    # -- the contract ---------------------------------------------------------------------

    def take_now(self, ticket: Ticket) -> Lease | None:
        return None  # a free slot is known only to Redis

    def release_now(self, lease: Lease) -> bool:
        return False

    async def acquire(self, ticket: Ticket, on_wait: WaitCallback | None = None) -> Lease:
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + ticket.max_wait_s
        while True:
            try:
                return await self._acquire_once(ticket, on_wait, began, deadline)
            except (RedisDown, Requeued):
                if loop.time() >= deadline:  # retried until the ticket's own deadline
                    raise QueueTimeout(
                        f"No slot for model `{ticket.model}` within {ticket.max_wait_s:g}s; "
                        "retry later.",
                        retry_after_s=self._cfg.max_wait_s,
                    ) from None

    async def release(self, lease: Lease) -> None:
        iid = lease.extra.get("iid")
        held = self._held.pop(iid, None) if isinstance(iid, str) else None
        if iid is None or held is None:
            return
        if held.local is not None:
            await self._local.release(held.local)
        if self._renewing is not None:
            self._renewing.append((iid, held.worker))
        if self._up:
            await asyncio.shield(self._spawn(self._release_remote(iid, held.worker)))

    def poke(self, worker: str) -> None:
        self._local.poke(worker)
        if self._up:
            self._spawn(self._dispatch([worker]))

    async def snapshot(self) -> dict[str, Any]:
        local = await self._local.snapshot()
        view: dict[str, Any] = {
            "backend": "redis",
            "replica": self.replica_id,
            "redis_up": self._up,
            "on_redis_down": str(self._policy),
            "models": local["models"],
            "workers": local["workers"],
            "local": local,
        }
        if self._up:
            try:
                view.update(await self._store.snapshot())
            except StoreUnavailable as exc:
                await self._suspect(exc)
            except StoreFailed as exc:
                log.exception("admission: reading the shared queue's state failed")
                raise ServiceUnavailable(
                    "The shared queue's state could not be read; retry later."
                ) from exc
        return view

    # -- acquiring ------------------------------------------------------------------------

    @property
    def _policy(self) -> RedisFailurePolicy:
        return self._cfg.on_redis_down

    async def _acquire_once(
        self, ticket: Ticket, on_wait: WaitCallback | None, began: float, deadline: float
    ) -> Lease:
        if self._up:
            return await self._redis_acquire(ticket, on_wait, began, deadline)
        if self._policy is RedisFailurePolicy.reject:
            raise ServiceUnavailable(
                "Admission is unavailable: the shared queue cannot be reached.",
                headers={"retry-after": str(max(1, math.ceil(self._renew_s)))},
            )
        loop = asyncio.get_running_loop()
        waiting = replace(ticket, max_wait_s=max(0.0, deadline - loop.time()))
        lease = await self._local.acquire(waiting, on_wait)
        iid = self._new_iid()
        self._held[iid] = _Held(lease.worker, ticket.tenant, local=lease)
        queued_s = loop.time() - began if lease.queued_s else 0.0
        return self._lease(iid, lease.worker, ticket.id, queued_s, "local")

    async def _redis_acquire(
        self, ticket: Ticket, on_wait: WaitCallback | None, began: float, deadline: float
    ) -> Lease:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(self._new_iid(), ticket, loop.create_future(), began)
        self._waiting[waiter.iid] = waiter
        try:
            return await self._redis_wait(waiter, on_wait, deadline)
        finally:
            del self._waiting[waiter.iid]
            consume(waiter.fut)

    async def _redis_wait(
        self, waiter: _Waiter, on_wait: WaitCallback | None, deadline: float
    ) -> Lease:
        try:
            worker = await self._enter(waiter)
            if worker is None:
                position = partial(self._position, waiter)
                keepalive = self._cfg.keepalive_interval_s
                worker = await wait_for_grant(waiter.fut, deadline, keepalive, position, on_wait)
            if worker is None:
                worker = await self._timed_out(waiter)
        except StoreUnavailable as exc:
            # not necessarily an outage (a timeout on a busy loop): the probe decides, and the
            # acquire is retried, through Redis or locally; a ticket the failed call may have
            # left behind is withdrawn (or its slot released) in the background
            await self._suspect(exc)
            self._spawn(self._withdraw(waiter.iid))
            raise RedisDown() from exc
        except StoreFailed as exc:
            # Redis rejected this call (a script's error, WRONGTYPE…) but is well: only this
            # request fails. What the call wrote before its error is withdrawn (or released).
            log.exception("admission: a Redis call failed; this request fails, Redis stays in use")
            await asyncio.shield(self._spawn(self._withdraw(waiter.iid)))
            raise ServiceUnavailable(
                "Admission failed for this request: the shared queue rejected a call; retry later."
            ) from exc
        except (QueueFull, QueueTimeout, RedisDown, Requeued, ServiceUnavailable):
            raise
        except BaseException:
            await asyncio.shield(self._spawn(self._withdraw(waiter.iid)))
            raise
        return self._granted(waiter, worker)

    async def _enter(self, waiter: _Waiter) -> str | None:
        """Run ``acquire``: the worker if granted at once, None if queued."""
        t = waiter.ticket
        out = await self._store.acquire(
            waiter.iid,
            self.replica_id,
            (t.id, t.model, t.tenant, t.priority),
            self._caps(unique(t.candidates)),
            (self._cfg.max_queued, self._cfg.max_queued_per_tenant or 0),
        )
        if out.status == "granted":
            return out.worker
        if out.status == "full":
            raise QueueFull(
                f"The queue for model `{t.model}` is full ({out.position} waiting); retry later.",
                retry_after_s=retry_after(out.position + 1, out.rate, self._cfg.max_wait_s),
            )
        if out.status == "tenant":
            raise QueueFull(
                tenant_full_message(t, out.waiting),
                retry_after_s=retry_after(out.position + 1, out.rate, self._cfg.max_wait_s),
            )
        waiter.key = out.key
        return None

    async def _timed_out(self, waiter: _Waiter) -> str:
        """Leave the queue at the deadline; a grant that raced the deadline wins."""
        out = await self._store.withdraw(waiter.iid)
        if out.status == "granted":
            return out.worker
        t = waiter.ticket
        raise QueueTimeout(
            f"No slot for model `{t.model}` within {t.max_wait_s:g}s; retry later.",
            retry_after_s=retry_after(out.position, out.rate, self._cfg.max_wait_s),
        )

    def _granted(self, waiter: _Waiter, worker: str) -> Lease:
        held = self._held[waiter.iid] = _Held(worker, waiter.ticket.tenant)
        if not self._up:  # granted just before Redis went away: count it in the local share
            held.local = self._local.force_hold(worker, waiter.ticket.id, held.tenant)
        loop = asyncio.get_running_loop()
        queued_s = loop.time() - waiter.began if waiter.key else 0.0
        return self._lease(waiter.iid, worker, waiter.ticket.id, queued_s, "redis")

    def _lease(self, iid: str, worker: str, ticket_id: str, queued_s: float, via: str) -> Lease:
        extra: dict[str, Any] = {"iid": iid, "replica": self.replica_id, "via": via}
        return Lease(worker=worker, ticket_id=ticket_id, queued_s=queued_s, extra=extra)

    async def _position(self, waiter: _Waiter) -> int:
        return await self._store.position(self._keys.queue(waiter.ticket.model), waiter.key)

    def _cap(self, worker: str) -> int:
        return self._workers.slots(worker)

    def _caps(self, workers: Iterable[str]) -> Caps:
        return [(name, self._cap(name)) for name in workers]

    def _new_iid(self) -> str:
        return f"{self.replica_id}|{next(self._ids)}"

    # -- background work ------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _release_remote(self, iid: str, worker: str) -> None:
        granted: list[tuple[str, str]] = []
        for _ in range(ATTEMPTS):  # the script is idempotent: retried while Redis is up
            if not self._up:
                return  # released locally; the lease expires with its TTL
            try:
                granted = await self._store.release(iid, worker, self._cap(worker))
                break
            except StoreUnavailable as exc:
                await self._suspect(exc)
            except StoreFailed:  # no longer renewed: the lease expires with its TTL
                log.exception("admission: releasing a slot failed; it expires with its lease")
                return
        for to, on in granted:  # our own waiters need not wait for the pub/sub echo
            self._wake(to, on)

    async def _withdraw(self, iid: str) -> None:
        """A waiter left without a lease: drop its ticket, or release a slot it raced to."""
        for _ in range(ATTEMPTS):  # both scripts are idempotent: retried while Redis is up
            if not self._up:
                break
            try:
                out = await self._store.withdraw(iid)
                if out.status == "granted":
                    await self._store.release(iid, out.worker, self._cap(out.worker))
                return
            except StoreUnavailable as exc:
                await self._suspect(exc)
            except StoreFailed:
                # the next renewal drops a ticket still waiting (``forget``); a slot it raced
                # to is not renewed and expires with its lease
                log.exception("admission: withdrawing a ticket failed; left to the renewal")
                return
        # a call may still reach Redis later (a hung server wakes up): withdrawn on recovery
        self._doubtful.add(iid)

    async def _dispatch(self, workers: list[str]) -> None:
        try:
            await self._store.recheck(self._caps(workers), [])
        except StoreUnavailable as exc:
            await self._suspect(exc)
        except StoreFailed:  # the maintenance loop's re-check dispatches again
            log.exception("admission: dispatching %s failed", ", ".join(workers))

    async def _suspect(self, exc: BaseException) -> bool:
        """A call failed: Redis is down if it refused the call (an error reply), else only if
        the probe fails too. True while it is up."""
        if self._up and (isinstance(exc, StoreRefused) or not await self._probe.reachable()):
            self._went_down(exc)
        return self._up

    def _went_down(self, exc: BaseException) -> None:
        if not self._up:
            return
        self._up = False
        how = "refused a call" if isinstance(exc, StoreRefused) else "unreachable"
        log.warning("admission: Redis %s (%s); policy %s", how, exc, self._policy)
        for iid, held in self._held.items():
            if held.local is None:
                held.local = self._local.force_hold(held.worker, iid, held.tenant)
        for waiter in self._waiting.values():
            if not waiter.fut.done():
                waiter.fut.set_exception(RedisDown())

    async def _recover(self) -> None:
        await self._ctl.ping()
        await self._renew()  # writes: a Redis that still refuses writes stays down
        self._up = True
        doubtful, self._doubtful = self._doubtful, set()
        for iid in doubtful:
            self._spawn(self._withdraw(iid))
        moved = self._local.requeue_all()
        log.info("admission: Redis reachable; %d local waiters moved back", moved)
        await self._renew()  # also assert what the local fallback granted during the first one

    async def _renew(self) -> None:
        """Heartbeat, re-assert held leases, drop this replica's orphaned tickets."""
        leases = [(iid, held.worker) for iid, held in self._held.items()]
        self._renewing = []
        try:
            listed = await self._ctl.renew(self.replica_id, leases)
        finally:
            released, self._renewing = self._renewing, None
        for iid, worker in released:  # released while the renew was in flight: undo a re-assert
            await self._ctl.release(iid, worker, self._cap(worker))
        await self._ctl.forget(self.replica_id, sorted(listed - self._waiting.keys()))

    async def _recheck(self) -> None:
        waiters = [w for w in self._waiting.values() if w.key]
        if not waiters:
            return
        workers = unique([name for w in waiters for name in w.ticket.candidates])
        states = await self._ctl.recheck(self._caps(workers), [w.iid for w in waiters])
        for waiter, state in zip(waiters, states, strict=True):
            if waiter.fut.done() or waiter.iid not in self._waiting:
                continue
            if state == "?":
                waiter.fut.set_exception(Requeued())
            elif state:
                waiter.fut.set_result(state)

    async def _maintain(self) -> None:
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + self._renew_s
        while not self._closing:
            await asyncio.sleep(self._recheck_s)
            try:
                if not self._up:
                    await self._recover()
                    next_renew = loop.time() + self._renew_s
                    continue
                await self._recheck()
                if loop.time() >= next_renew:
                    next_renew = loop.time() + self._renew_s
                    await self._renew()
            except StoreUnavailable as exc:
                await self._suspect(exc)
            except Exception:
                log.exception("admission: maintenance step failed")

    async def _listen(self) -> None:
        channel = self._keys.wake(self.replica_id)
        while not self._closing:
            with contextlib.suppress(*REDIS_FAILURES):
                async with self._control.pubsub() as pubsub:
                    await pubsub.subscribe(channel)
                    while not self._closing:
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                        if msg is not None:
                            self._on_wake(str(msg["data"]))
            if not self._closing:
                await asyncio.sleep(self._recheck_s)

    def _on_wake(self, data: str) -> None:
        iid, _, worker = data.rpartition(" ")
        self._wake(iid, worker)

    def _wake(self, iid: str, worker: str) -> None:
        waiter = self._waiting.get(iid)
        if waiter is not None and not waiter.fut.done():
            waiter.fut.set_result(worker)
