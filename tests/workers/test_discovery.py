"""Discovery's bookkeeping with a scripted resolver (the real DNS server is in tests/deploy):
joins, drains that wait for running requests, failures that keep the set, reloads, close."""

from __future__ import annotations

import asyncio
import resource

import pytest
from pydantic import ValidationError

from gpupool.config.models import DiscoverConfig, WorkerConfig
from gpupool.workers.discovery import (
    Discovery,
    DiscoveryError,
    DiscoveryHooks,
    Target,
    workers_for_descriptors,
)
from gpupool.workers.registry import Registry, Worker, WorkerState


class Script:
    """Answers per name, set by the test; an exception answer raises it."""

    def __init__(self) -> None:
        self.answers: dict[str, set[Target] | Exception] = {}

    def __call__(self, spec: DiscoverConfig) -> Script:
        return self

    async def resolve(self, spec: DiscoverConfig) -> set[Target]:
        answer = self.answers[spec.dns]
        if isinstance(answer, Exception):
            raise answer
        return set(answer)


class Host:
    """The hooks, recording what discovery asked, over a real registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.joined: list[str] = []
        self.removed: list[str] = []
        self.failures: list[str] = []

    def hooks(self) -> DiscoveryHooks:
        return DiscoveryHooks(self.make, self.join, self.drain, self.remove, self.failures.append)

    def make(self, wc: WorkerConfig) -> Worker:
        return Worker(name=wc.name, model=wc.model, url=wc.url, capacity=wc.max_inflight or 4)

    async def join(self, w: Worker) -> None:
        self.joined.append(w.name)

    async def drain(self, w: Worker, timeout_s: float) -> None:
        self.registry.transition(w, WorkerState.draining)
        await self.registry.wait_idle(w, timeout_s)
        self.registry.transition(w, WorkerState.stopped)

    def remove(self, w: Worker) -> None:
        self.removed.append(w.name)


def _entry(
    name: str = "pool", dns: str = "pool.test", max_inflight: int | None = None
) -> WorkerConfig:
    spec = {"dns": dns, "port": 8000, "every_s": 3600}
    data = {"name": name, "model": "m", "discover": spec, "max_inflight": max_inflight}
    return WorkerConfig.model_validate(data)


def _setup(*entries: WorkerConfig) -> tuple[Discovery, Host, Script]:
    registry, script = Registry(), Script()
    host = Host(registry)
    return Discovery(registry, entries, host.hooks(), resolver=script), host, script


async def test_new_addresses_join_as_url_workers_in_starting() -> None:
    disc, host, script = _setup(_entry(max_inflight=7))
    script.answers["pool.test"] = {Target("10.0.0.2", 8000), Target("fd00::3", 8000)}
    await disc.refresh("pool")
    workers = {w.name: w for w in disc.workers("pool")}
    assert set(workers) == {"pool@10.0.0.2:8000", "pool@[fd00::3]:8000"}
    assert workers["pool@[fd00::3]:8000"].url == "http://[fd00::3]:8000"
    assert all(w.state is WorkerState.starting and w.capacity == 7 for w in workers.values())
    assert sorted(host.joined) == sorted(workers)
    await disc.refresh("pool")  # the same answer: nothing joins again
    assert len(host.joined) == 2


async def test_a_vanished_worker_drains_its_running_requests_then_goes() -> None:
    disc, host, script = _setup(_entry())
    script.answers["pool.test"] = {Target("10.0.0.2", 8000), Target("10.0.0.3", 8000)}
    await disc.refresh("pool")
    leaving = disc.registry.get("pool@10.0.0.3:8000")
    assert leaving is not None
    disc.registry.transition(leaving, WorkerState.ready)
    disc.registry.started(leaving.name)  # a request running on it
    script.answers["pool.test"] = {Target("10.0.0.2", 8000)}
    await disc.refresh("pool")
    await asyncio.sleep(0.05)
    assert leaving.state is WorkerState.draining and not leaving.routable
    assert disc.registry.get(leaving.name) is leaving and host.removed == []
    disc.registry.finished(leaving.name)
    for _ in range(100):
        if host.removed:
            break
        await asyncio.sleep(0.01)
    assert host.removed == [leaving.name] and disc.registry.get(leaving.name) is None
    assert [w.name for w in disc.workers("pool")] == ["pool@10.0.0.2:8000"]


async def test_a_failed_lookup_keeps_the_last_good_set_and_is_counted() -> None:
    disc, host, script = _setup(_entry())
    script.answers["pool.test"] = {Target("10.0.0.2", 8000)}
    await disc.refresh("pool")
    script.answers["pool.test"] = DiscoveryError("A pool.test: timed out")
    await disc.refresh("pool")
    await disc.refresh("pool")
    assert host.failures == ["pool", "pool"]
    assert [w.name for w in disc.workers("pool")] == ["pool@10.0.0.2:8000"]
    script.answers["pool.test"] = set()  # an answer: none
    await disc.refresh("pool")
    await asyncio.sleep(0.05)
    assert disc.workers("pool") == [] and host.removed == ["pool@10.0.0.2:8000"]


async def test_replace_retires_changed_entries_and_starts_new_ones() -> None:
    disc, host, script = _setup(_entry("a", "a.test"), _entry("b", "b.test"))
    script.answers |= {
        "a.test": {Target("10.0.0.2", 8000)},
        "b.test": {Target("10.0.1.2", 8000)},
        "c.test": {Target("10.0.2.2", 8000)},
    }
    await disc.start()
    await disc.replace([_entry("a", "a.test"), _entry("c", "c.test")])
    await asyncio.sleep(0.05)
    assert host.removed == ["b@10.0.1.2:8000"]
    assert sorted(w.name for w in disc.registry) == ["a@10.0.0.2:8000", "c@10.0.2.2:8000"]
    await disc.close()
    assert all(t.done() for t in disc._loops.values()) and not disc._loops


def test_discover_config_needs_a_port_for_a_records_and_is_one_source() -> None:
    with pytest.raises(ValidationError, match="port"):
        DiscoverConfig.model_validate({"dns": "x"})
    assert DiscoverConfig.model_validate({"dns": "_v._tcp.x", "record": "srv"}).port is None
    with pytest.raises(ValidationError, match="exactly one of"):
        WorkerConfig.model_validate(
            {"name": "w", "model": "m", "url": "http://h:1", "discover": {"dns": "x", "port": 1}}
        )


async def test_replace_keeps_workers_when_only_the_lookup_changed() -> None:
    disc, host, script = _setup(_entry("a", "a.test", max_inflight=4))
    script.answers |= {"a.test": {Target("10.0.0.2", 8000)}, "a2.test": {Target("10.0.0.2", 8000)}}
    await disc.refresh("a")
    (kept,) = disc.workers("a")
    await disc.replace([_entry("a", "a2.test", max_inflight=4)])  # another name, same address
    await asyncio.sleep(0.05)
    assert disc.workers("a") == [kept] and host.removed == []
    await disc.replace([_entry("a", "a2.test", max_inflight=9)])  # the workers' own settings
    for _ in range(100):
        if host.removed:
            break
        await asyncio.sleep(0.01)
    assert host.removed == [kept.name]
    await disc.refresh("a")  # the next lookup brings it back with the new capacity
    assert [w.capacity for w in disc.workers("a")] == [9]
    await disc.close()


# ---- bounded at scale (issue 35: one answer of 4,000 addresses) ------------------------------


def _many(n: int, base: str = "10.0") -> set[Target]:
    return {Target(f"{base}.{i // 250}.{i % 250 + 1}", 8000) for i in range(n)}


async def test_an_answer_beyond_max_workers_is_cut_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entry = WorkerConfig.model_validate({"name": "pool", "model": "m", "discover": {
        "dns": "pool.test", "port": 8000, "every_s": 3600, "max_workers": 3}})  # fmt: skip
    dropped: list[int] = []
    registry, script = Registry(), Script()
    host = Host(registry)
    hooks = DiscoveryHooks(host.make, host.join, host.drain, host.remove, host.failures.append,
                           lambda _entry, n: dropped.append(n))  # fmt: skip
    disc = Discovery(registry, [entry], hooks, resolver=script, max_total=1000)
    script.answers["pool.test"] = _many(4000)
    await disc.refresh("pool")
    names = sorted(w.name for w in disc.workers("pool"))
    assert names == ["pool@10.0.0.1:8000", "pool@10.0.0.2:8000", "pool@10.0.0.3:8000"]
    await disc.refresh("pool")
    assert dropped == [3997, 3997]
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == [
        "discover pool: 3997 of 4000 addresses left out (max_workers: 3 workers; "
        "raise discover.max_workers or `ulimit -n`)"
    ]
    # a lower address appears: the workers already in the pool stay (no churn)
    script.answers["pool.test"] = _many(4000) | {Target("9.0.0.1", 8000)}
    await disc.refresh("pool")
    assert sorted(w.name for w in disc.workers("pool")) == names and dropped[-1] == 3998
    assert len(host.joined) == 3
    # one of them leaves DNS: the next lowest takes its place
    script.answers["pool.test"] = _many(4000) - {Target("10.0.0.2", 8000)}
    await disc.refresh("pool")
    await asyncio.sleep(0.05)
    assert "pool@10.0.0.4:8000" in {w.name for w in disc.workers("pool")}
    await disc.close()


async def test_the_descriptor_budget_is_shared_by_every_entry() -> None:
    disc, _, script = _setup(_entry("a", "a.test"), _entry("b", "b.test"))
    disc.max_total = 5
    script.answers |= {"a.test": _many(4, "10.1"), "b.test": _many(4, "10.2")}
    await disc.refresh("a")
    await disc.refresh("b")
    assert len(disc.workers("a")) == 4 and len(disc.workers("b")) == 1
    await disc.close()


def test_descriptors_left_for_workers_keep_the_gateways_own_share() -> None:
    assert workers_for_descriptors(1024) == (1024 - 256) // 4
    assert workers_for_descriptors(65536) == (65536 - 16384) // 4
    assert workers_for_descriptors(100) == 0
    assert workers_for_descriptors(resource.RLIM_INFINITY) > 1_000_000
