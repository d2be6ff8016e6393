"""Per-key limits against the memory store and real ``redis-server`` processes.

``store`` is parametrized: ``memory`` (one replica) and ``redis`` (two replicas sharing one
Redis, requests alternating between them), so every rule is checked where it must hold across
replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpupool.config.models import ApiKey, GpupoolConfig
from gpupool.gateway.errors import RateLimited
from gpupool.gateway.security.keys import Principal, hash_key
from gpupool.gateway.security.limits import KeyLimits
from gpupool.gateway.security.limits.base import Limit, Policy
from gpupool.gateway.security.limits.memory import MemoryLimits
from tests.conftest import RedisServer
from tests.support.procs import gateway, running, sim
from tests.support.procs import redis_server as redis_proc

ROOT = Path(__file__).resolve().parents[3]


def principal(name: str = "alice", **limits: int) -> Principal:
    key = ApiKey(name=name, sha256="a" * 64, **limits)
    return Principal(name, name, key=key)


Build = Callable[..., Awaitable[KeyLimits]]


@pytest.fixture
async def build(redis_server: RedisServer) -> AsyncIterator[Build]:
    """``build(url=..., prefix=..., **kw)``: a KeyLimits, closed after the test."""
    made: list[KeyLimits] = []
    prefix = f"test-{uuid.uuid4().hex[:8]}"

    async def make(url: str | None = redis_server.url, **kw: Any) -> KeyLimits:
        kw.setdefault("lease_ttl_s", 2.0)
        limits = KeyLimits(url, kw.pop("prefix", prefix), **kw)
        made.append(limits)
        return limits

    yield make
    for limits in made:
        await limits.aclose()


class Replicas:
    """One or two KeyLimits sharing a store; ``next`` alternates between them."""

    def __init__(self, replicas: list[KeyLimits]) -> None:
        self.all = replicas
        self._n = 0

    @property
    def next(self) -> KeyLimits:
        self._n += 1
        return self.all[self._n % len(self.all)]


@pytest.fixture(params=["memory", "redis"])
async def replicas(request: pytest.FixtureRequest, build: Build) -> Replicas:
    if request.param == "memory":
        return Replicas([await build(url=None)])
    return Replicas([await build(), await build()])


async def test_concurrency_is_shared_by_every_replica(replicas: Replicas) -> None:
    alice = principal(max_concurrent=2)
    a = await replicas.next.admit(alice)
    b = await replicas.next.admit(alice)
    for limits in replicas.all:
        with pytest.raises(RateLimited) as err:
            await limits.admit(alice)
        assert err.value.status == 429 and "2 requests in flight" in err.value.message
        assert await limits.in_use("alice") == 2
    await a.close(None)
    c = await replicas.next.admit(alice)  # the freed slot is usable from any replica
    await b.close(None)
    await c.close(None)
    for limits in replicas.all:
        assert await limits.in_use("alice") == 0


async def test_a_burst_cannot_overrun_the_token_budget(replicas: Replicas) -> None:
    alice = principal(tpm=1000)

    async def one(i: int) -> bool:
        try:
            await replicas.all[i % len(replicas.all)].admit(alice, 200)
        except RateLimited as err:
            assert "tokens per minute" in err.message
            assert 1 <= err.retry_after_s <= 60
            return False
        return True

    admitted = await asyncio.gather(*(one(i) for i in range(40)))
    assert sum(admitted) == 5  # 5 x 200 reserved = the whole budget, before any request ends
    usage = await replicas.all[0].usage("alice")
    assert (usage.reserved, usage.tokens, usage.in_use) == (1000, 1000, 5)


async def test_settling_refunds_or_charges_the_difference(replicas: Replicas) -> None:
    alice = principal(tpm=1000)
    big = await replicas.next.admit(alice, 600)
    assert await replicas.next.reserved("alice") == 600
    with pytest.raises(RateLimited):
        await replicas.next.admit(alice, 600)
    await big.close(100)  # used less: the rest comes back at once
    usage = await replicas.next.usage("alice")
    assert (usage.tokens, usage.reserved, usage.in_use) == (100, 0, 0)
    more = await replicas.next.admit(alice, 800)
    await more.close(950)  # used more than reserved (no max_tokens): charged in full
    assert (await replicas.next.usage("alice")).tokens == 1050
    with pytest.raises(RateLimited):
        await replicas.next.admit(alice)  # even a request reserving nothing needs a token


async def test_unknown_usage_keeps_the_reservation(replicas: Replicas) -> None:
    alice = principal(tpm=1000)
    hold = await replicas.next.admit(alice, 300)
    await hold.close(None)
    usage = await replicas.next.usage("alice")
    assert (usage.tokens, usage.reserved, usage.in_use) == (300, 0, 0)


async def test_a_reservation_above_the_budget_waits_for_an_empty_budget(
    replicas: Replicas,
) -> None:
    alice = principal(tpm=1000)
    huge = await replicas.next.admit(alice, 50_000)  # clamped to the budget, not refused
    assert await replicas.next.reserved("alice") == 1000
    await huge.close(40)
    with pytest.raises(RateLimited):  # needs the whole budget again: 40 are spent
        await replicas.next.admit(alice, 50_000)
    fits = await replicas.next.admit(alice, 960)
    await fits.close(None)
    assert (await replicas.next.usage("alice")).tokens == 1000


async def test_close_is_idempotent_and_finishes_under_cancellation(replicas: Replicas) -> None:
    alice = principal(tpm=1000, max_concurrent=3)
    hold = await replicas.next.admit(alice, 100)
    await hold.close(10)
    await hold.close(500)  # a second close changes nothing
    usage = await replicas.next.usage("alice")
    assert (usage.tokens, usage.in_use) == (10, 0)

    holds = [await replicas.next.admit(alice, 100) for _ in range(3)]

    async def closes_late(h: Any) -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await h.close(20)

    tasks = [asyncio.create_task(closes_late(h)) for h in holds]
    await asyncio.sleep(0.01)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    usage = await replicas.next.usage("alice")
    assert (usage.tokens, usage.in_use, usage.reserved) == (70, 0, 0)


async def test_a_refused_request_costs_no_budget(replicas: Replicas) -> None:
    alice = principal(rpm=2, max_concurrent=1)
    first = await replicas.next.admit(alice)
    with pytest.raises(RateLimited) as err:  # refused by concurrency...
        await replicas.next.admit(alice)
    assert "in flight" in err.value.message
    await first.close(None)
    second = await replicas.next.admit(alice)  # ...so it did not use one of the 2 per minute
    await second.close(None)
    with pytest.raises(RateLimited) as err:
        await replicas.next.admit(alice)
    assert "2 requests per minute" in err.value.message
    assert 55 <= err.value.retry_after_s <= 60


async def test_keys_without_limits_cost_nothing(replicas: Replicas) -> None:
    hold = await replicas.next.admit(principal())
    assert hold.limits is None
    await hold.close(123)
    assert (await replicas.next.admit(None)).limits is None


async def test_a_dead_replicas_slots_come_back_within_the_ttl(
    build: Build, redis_server: RedisServer
) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}"
    # 1.5 s, not 0.6: a live lease is renewed every TTL / 3, and a loaded machine's stall of a
    # replica (this process or the killed one) must stay inside its lease (as in tests/admission)
    ttl_s = 1.5
    alive = await build(prefix=prefix, lease_ttl_s=ttl_s)
    held = await alive.admit(principal("bob", max_concurrent=1))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gateway.security.limits_proc", redis_server.url, prefix,
        str(ttl_s), cwd=ROOT, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 20)).strip() == b"held"
    await asyncio.sleep(ttl_s + 0.5)  # past the TTL: both replicas keep renewing what they hold
    assert await alive.in_use("alice") == 1
    assert await alive.in_use("bob") == 1
    with pytest.raises(RateLimited):
        await alive.admit(principal(max_concurrent=1))
    proc.kill()  # SIGKILL: no release, no renewals
    await proc.wait()
    died = time.monotonic()
    while await alive.in_use("alice"):
        assert time.monotonic() - died < ttl_s + 10  # its lease runs out; slack for load
        await asyncio.sleep(0.05)
    await alive.admit(principal(max_concurrent=1))
    assert await alive.in_use("bob") == 1  # a live replica's hold outlived the TTL
    await held.close(None)


async def test_fail_open_to_local_limits_while_redis_is_down(
    build: Build, own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpupool.limits")
    alice = principal(max_concurrent=1, tpm=1000)
    limits = await build(url=own_redis.url, lease_ttl_s=0.6)
    shared = await limits.admit(alice, 100)
    await own_redis.akill()
    local = await limits.admit(alice, 100)  # the shared slot is out of sight: admitted here
    assert not limits.redis_up
    assert "Redis unreachable" in caplog.text
    with pytest.raises(RateLimited):
        await limits.admit(alice, 100)  # still limited on this replica
    await shared.close(10)  # its lease expires in Redis; no error
    await local.close(10)
    await own_redis.astart()
    began = time.monotonic()
    while not limits.redis_up:
        assert time.monotonic() - began < 5
        await asyncio.sleep(0.05)
    again = await limits.admit(alice, 100)
    assert await limits.in_use("alice") == 1
    await again.close(None)
    assert await limits.in_use("alice") == 0


def test_the_reservation_default_comes_from_the_config() -> None:
    cfg = GpupoolConfig.model_validate(
        {
            "models": [{"name": "m"}],
            "workers": [{"name": "w", "model": "m", "url": "http://127.0.0.1:1"}],
            "auth": {"tpm_reserve_tokens": 512},
        }
    )
    limits = KeyLimits.from_config(cfg)
    assert limits.reserve_for(30, None) == 542
    assert limits.reserve_for(30, 8) == 38
    assert limits.reserve_for(30, 8, n=4) == 62
    assert limits.reserve_for(30, 0) == 30  # embeddings: the prompt only


async def test_the_window_slides() -> None:
    now = [1000.0]
    store = MemoryLimits(clock=lambda: now[0])
    policy = Policy(tpm=1000)
    assert await store.take("k", policy, "a", 600) is None
    now[0] += 30
    assert await store.take("k", policy, "b", 300) is None
    refusal = await store.take("k", policy, "c", 200)
    assert refusal is not None and refusal.limit is Limit.tpm
    assert refusal.retry_after_s == pytest.approx(30)  # when `a` leaves the window
    now[0] += 30.01
    assert await store.take("k", policy, "c", 600) is None
    await store.give("k", policy, "a", 600, 900)  # `a` left the window: the excess is new
    assert (await store.usage("k")).tokens == 300 + 600 + 300


def test_max_concurrent_holds_across_two_gateway_processes(tmp_path: Path) -> None:
    """Through the real HTTP path: a key's one slot, taken on gateway A, is taken on B too."""
    secret = "sk-one-at-a-time"
    keys = [{"name": "solo", "sha256": hash_key(secret), "max_concurrent": 1}]
    redis = redis_proc(tmp_path)
    worker = sim(model="m", tmp=tmp_path, max_num_seqs=8, ttft_ms=1500)
    with running(redis), running(worker):
        cfg = {
            "models": [{"name": "m"}],
            "workers": [{"name": "w", "model": "m", "url": worker.url}],
            "auth": {"enabled": True, "keys": keys},
            "queue": {"backend": "redis", "redis_url": redis.url},
        }
        a, b = gateway(cfg, tmp_path), gateway(cfg, tmp_path)
        with running(a, b), ThreadPoolExecutor(1) as pool:
            body = {"model": "m", "prompt": "x", "max_tokens": 1}
            headers = {"authorization": f"Bearer {secret}"}
            post = partial(httpx.post, json=body, headers=headers, timeout=30)
            slow = pool.submit(post, a.url + "/v1/completions")
            _until_inflight(a.url, 1)  # A's request holds the slot, waiting for its first token
            refused = post(b.url + "/v1/completions")
            assert slow.result().status_code == 200
            assert refused.status_code == 429, refused.text
            assert "in flight" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "1"
            _until_inflight(a.url, 0)  # A answered; its slot goes back as its request ends
            again = post(b.url + "/v1/completions")
            for _ in range(50):  # A's release reaches Redis just after: retry, as Retry-After says
                if again.status_code != 429:
                    break
                time.sleep(0.1)
                again = post(b.url + "/v1/completions")
            assert again.status_code == 200, again.text  # freed for both


def _until_inflight(url: str, n: float, within_s: float = 30) -> None:
    """Wait until the gateway at ``url`` has ``n`` requests in flight (``gpupool_inflight``)."""
    deadline = time.monotonic() + within_s
    while True:
        text = httpx.get(url + "/metrics", timeout=5).text
        now = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                  if ln.startswith("gpupool_inflight{"))  # fmt: skip
        if now == n:
            return
        assert time.monotonic() < deadline, f"{now} in flight, not {n}"
        time.sleep(0.05)


async def test_a_call_lost_to_a_hung_redis_is_undone_when_it_answers(
    build: Build, own_redis: RedisServer
) -> None:
    alice = principal(tpm=1000, max_concurrent=5)
    limits = await build(url=own_redis.url, lease_ttl_s=2.0)
    await (await limits.admit(alice, 1)).close(1)
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)  # no refusal: calls and probe time out
    try:
        hold = await asyncio.wait_for(limits.admit(alice, 300), 10)
        assert not limits.redis_up
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    await hold.close(10)  # settled locally
    began = time.monotonic()
    while (await limits.usage("alice")).tokens != 11:  # 1 shared + 10 local, not + 300
        assert time.monotonic() - began < 5
        await asyncio.sleep(0.05)
    usage = await limits.usage("alice")
    assert (usage.in_use, usage.reserved) == (0, 0)
