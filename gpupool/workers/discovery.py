"""Workers found by DNS: ``workers: [{name, model, discover: {dns, port, every_s}}]``.

Each ``discover:`` entry is resolved every ``every_s`` seconds (A and AAAA records with the
entry's port, or SRV records with their own ports), as Compose service names and Kubernetes
headless Services resolve. What the name returns is the entry's set of workers:

- a new address becomes a ``url:`` worker named ``<entry>@<host>:<port>``, in ``starting``: the
  remote poller probes it like any ``url:`` worker and it takes requests only once the probe
  passes (``/health`` and ``/v1/models`` listing the model);
- an address gone from the answer is drained (no new requests, the running ones finish, up to
  ``drain_s``), then removed;
- an answer larger than the entry's ``max_workers``, or than the descriptors the gateway can
  spare for workers (:func:`workers_for_descriptors`, shared by every entry), is cut: the
  workers already in the pool stay, then the lowest addresses join; the rest are left out,
  logged when their number changes and reported through ``DiscoveryHooks.dropped``
  (``gpupool_discovery_dropped``), so one DNS name of 4,000 addresses cannot take every
  descriptor, metric series and page row of the gateway;
- a failed lookup (timeout, SERVFAIL, no server) changes nothing: the last good set stays, the
  failure is logged and counted (``gpupool_discovery_failures_total``). A name that does not
  exist (NXDOMAIN) or has no records is an answer, the empty set: a service scaled to zero.

The module owns no worker state: it adds to and removes from the registry through
:class:`DiscoveryHooks`, which the gateway's services provide. Resolving is dnspython's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import resource
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpupool.config.models import DiscoverConfig, DiscoverRecord, WorkerConfig
from gpupool.workers.registry import Registry, Worker, WorkerState

if TYPE_CHECKING:
    import dns.nameserver
    import dns.rdata

log = logging.getLogger("gpupool.discovery")


class DiscoveryError(Exception):
    """A lookup failed: no answer could be had (the name's records are unknown, not empty)."""


@dataclass(frozen=True, slots=True, order=True)
class Target:
    host: str  # an IP address, or an SRV target name
    port: int

    def url(self, scheme: str = "http") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def worker_name(self, entry: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{entry}@{host}:{self.port}"


class Resolver(Protocol):
    async def resolve(self, spec: DiscoverConfig) -> set[Target]: ...


class DnsResolver:
    """dnspython's asyncio resolver, one per ``discover:`` entry (its own nameservers).

    dnspython is imported by the first one: a pool without ``discover:`` entries never loads it
    (0.04 s of CPU at every ``gpupool serve``'s start)."""

    def __init__(self, spec: DiscoverConfig) -> None:
        import dns.asyncresolver

        self._resolver = dns.asyncresolver.Resolver(configure=not spec.nameservers)
        if spec.nameservers:
            self._resolver.nameservers = [_nameserver(s) for s in spec.nameservers]
        self._resolver.lifetime = spec.timeout_s

    async def resolve(self, spec: DiscoverConfig) -> set[Target]:
        if spec.record is DiscoverRecord.srv:
            return await self._srv(spec.dns)
        assert spec.port is not None  # the config requires it for A records
        return {Target(ip, spec.port) for ip in await self._addresses(spec.dns)}

    async def _addresses(self, name: str) -> set[str]:
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            found |= {rr.to_text() for rr in await self._query(name, rdtype)}
        return found

    async def _srv(self, name: str) -> set[Target]:
        from dns.rdtypes.IN.SRV import SRV

        out: set[Target] = set()
        for rr in await self._query(name, "SRV"):
            assert isinstance(rr, SRV)
            host = rr.target.to_text(omit_final_dot=True)
            for ip in await self._addresses(host) if not _is_ip(host) else {host}:
                out.add(Target(ip, int(rr.port)))
        return out

    async def _query(self, name: str, rdtype: str) -> list[dns.rdata.Rdata]:
        import dns.exception
        import dns.resolver

        try:
            answer = await self._resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []  # an answer: no such records
        except dns.exception.DNSException as e:
            raise DiscoveryError(f"{rdtype} {name}: {type(e).__name__}: {e}") from None
        return list(answer)


def _nameserver(spec: str) -> dns.nameserver.Do53Nameserver:
    """``ip``, ``ip:port`` or ``[v6]:port`` (config validation leaves the form to here)."""
    import dns.nameserver

    host, port = spec, 53
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = int(rest.lstrip(":") or 53)
    elif spec.count(":") == 1:
        host, _, p = spec.partition(":")
        port = int(p)
    return dns.nameserver.Do53Nameserver(host, port)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# Descriptors a discovered worker may hold (an estimate: the health check's and the scrape's
# pooled connections, and one or two of the data path's), and those the gateway keeps for
# itself (clients, listening socket, logs, Redis, DNS) whatever the workers take.
FDS_PER_WORKER = 4
FDS_RESERVED_MIN = 256


def workers_for_descriptors(soft_limit: int | None = None) -> int:
    """How many discovered workers the process's descriptor limit (``ulimit -n``) can hold
    after the gateway's own share (a quarter of the limit, at least ``FDS_RESERVED_MIN``)."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return 1 << 30
    reserved = max(FDS_RESERVED_MIN, soft_limit // 4)
    return max(0, (soft_limit - reserved) // FDS_PER_WORKER)


def _address_order(target: Target) -> tuple[int, int, str, int]:
    try:
        ip = ipaddress.ip_address(target.host)
    except ValueError:
        return (9, 0, target.host, target.port)
    return (ip.version, int(ip), "", target.port)


@dataclass(frozen=True, slots=True)
class DiscoveryHooks:
    """What discovery asks of the gateway's services."""

    make: Callable[[WorkerConfig], Worker]  # a registry worker for a url: worker config
    joined: Callable[[Worker], Awaitable[None]]  # added to the registry: probe it
    drain: Callable[[Worker, float], Awaitable[None]]  # running requests finish, then stopped
    removed: Callable[[Worker], None]  # taken out of the registry: forget its series
    failed: Callable[[str], None]  # a lookup of this entry failed
    dropped: Callable[[str, int], None] = lambda entry, n: None  # addresses left out, each answer


class Discovery:
    """Keeps each ``discover:`` entry's workers equal to what its name resolves to."""

    def __init__(
        self,
        registry: Registry,
        entries: Iterable[WorkerConfig],
        hooks: DiscoveryHooks,
        resolver: Callable[[DiscoverConfig], Resolver] = DnsResolver,
        max_total: int | None = None,
    ) -> None:
        self.registry = registry
        self.hooks = hooks
        # every entry's workers together (None: what the descriptor limit allows)
        self.max_total = workers_for_descriptors() if max_total is None else max_total
        self._dropped: dict[str, int] = {}  # entry -> addresses its last answer left out
        self._make_resolver = resolver
        self._entries: dict[str, WorkerConfig] = {}
        self._resolvers: dict[str, Resolver] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._draining: dict[str, asyncio.Task[None]] = {}  # worker name -> its drain
        for wc in entries:
            self._add_entry(wc)

    def _add_entry(self, wc: WorkerConfig) -> None:
        assert wc.discover is not None
        self._entries[wc.name] = wc
        self._resolvers[wc.name] = self._make_resolver(wc.discover)

    async def start(self) -> None:
        """One lookup of every entry (the gateway starts knowing its workers), then the loops."""
        await asyncio.gather(*(self.refresh(name) for name in self._entries))
        for name in self._entries:
            self._loops[name] = asyncio.create_task(self._loop(name))

    async def _loop(self, name: str) -> None:
        while True:
            spec = self._entries[name].discover
            assert spec is not None
            await asyncio.sleep(spec.every_s)
            await self.refresh(name)

    def workers(self, entry: str) -> list[Worker]:
        """The registry's workers that ``entry`` found (draining ones included)."""
        return self._workers_of(self._entries[entry])

    def _workers_of(self, wc: WorkerConfig) -> list[Worker]:
        prefix = f"{wc.name}@"
        return [w for w in self.registry.of_model(wc.model) if w.name.startswith(prefix)]

    async def refresh(self, entry: str) -> None:
        """Resolve ``entry`` once and bring its workers in line with the answer."""
        wc = self._entries[entry]
        spec = wc.discover
        assert spec is not None
        try:
            found = await self._resolvers[entry].resolve(spec)
        except DiscoveryError as e:
            log.warning("discover %s: lookup failed, keeping %d workers: %s",
                        entry, len(self.workers(entry)), e)  # fmt: skip
            self.hooks.failed(entry)
            return
        have = {w.name: w for w in self.workers(entry)}
        wanted = self._capped(entry, spec, found, have)
        joining = sorted(set(wanted) - set(have))
        await asyncio.gather(*(self._join(wc, n, wanted[n].url(spec.scheme)) for n in joining))
        for name in sorted(set(have) - set(wanted)):
            if name not in self._draining:
                self._draining[name] = asyncio.create_task(self._retire(have[name], spec.drain_s))

    def _capped(
        self, entry: str, spec: DiscoverConfig, found: set[Target], have: dict[str, Worker]
    ) -> dict[str, Target]:
        """The part of ``found`` this entry takes: at most ``spec.max_workers``, and no more
        than the descriptor budget leaves after the other entries' workers; those already
        here first (no churn), then by address."""
        others = sum(1 for w in self.registry if "@" in w.name and w.name not in have
                     and w.name.partition("@")[0] in self._entries)  # fmt: skip
        room = max(0, min(spec.max_workers, self.max_total - others))
        order = sorted(found, key=lambda t: (t.worker_name(entry) not in have, _address_order(t)))
        kept = {t.worker_name(entry): t for t in order[:room]}
        dropped = len(found) - len(kept)
        if dropped != self._dropped.get(entry, 0):
            limit = "max_workers" if room == spec.max_workers else "the descriptor limit"
            log.warning("discover %s: %d of %d addresses left out (%s: %d workers; "
                        "raise discover.max_workers or `ulimit -n`)",
                        entry, dropped, len(found), limit, room)  # fmt: skip
        self._dropped[entry] = dropped
        self.hooks.dropped(entry, dropped)
        return kept

    async def _join(self, wc: WorkerConfig, name: str, url: str) -> None:
        worker = self.hooks.make(wc.model_copy(update={"name": name, "url": url, "discover": None}))
        self.registry.add(worker)
        log.info("discover %s: %s joins (%s), probing", wc.name, name, url)
        await self.hooks.joined(worker)

    async def _retire(self, worker: Worker, drain_s: float) -> None:
        try:
            log.info("discover: %s left DNS, draining", worker.name)
            if worker.state is not WorkerState.stopped:
                await self.hooks.drain(worker, drain_s)
            if self.registry.get(worker.name) is worker:
                self.registry.remove(worker.name)
                self.hooks.removed(worker)
            log.info("discover: %s removed", worker.name)
        finally:
            self._draining.pop(worker.name, None)

    async def replace(self, entries: Iterable[WorkerConfig]) -> None:
        """Config reload: entries gone stop (their workers drain and go); new ones start; a
        changed one resolves again with its new settings, keeping the workers it still finds
        unless their own settings (model, capacity, window) changed, when they are replaced."""
        fresh = {wc.name: wc for wc in entries}
        for name in [n for n, wc in self._entries.items() if fresh.get(n) != wc]:
            await self._stop_loop(name)
            old = self._entries.pop(name)
            self._resolvers.pop(name, None)
            new = fresh.get(name)
            if new is None or _worker_part(new) != _worker_part(old):
                assert old.discover is not None
                for w in self._workers_of(old):
                    if w.name not in self._draining:
                        self._draining[w.name] = asyncio.create_task(
                            self._retire(w, old.discover.drain_s)
                        )
        for name, wc in fresh.items():
            if name not in self._entries:
                self._add_entry(wc)
                await self.refresh(name)
                self._loops[name] = asyncio.create_task(self._loop(name))

    async def _stop_loop(self, name: str) -> None:
        task = self._loops.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        for name in list(self._loops):
            await self._stop_loop(name)
        drains = list(self._draining.values())
        for task in drains:
            task.cancel()
        for task in drains:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _worker_part(wc: WorkerConfig) -> WorkerConfig:
    """What the entry's workers are made of (all but how they are found)."""
    return wc.model_copy(update={"discover": None})
