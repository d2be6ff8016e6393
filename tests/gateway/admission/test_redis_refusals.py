"""Admission and per-key limits on a Redis that answers with errors, through the real front door.

The gateway's app (``create_app``) in-process over ASGI, a recording worker on a loopback port,
``queue.backend: redis`` on a real ``redis-server`` (admission's slots and queue, the key's
limits, stored responses' owners), policy ``reject``. Redis full (``maxmemory`` 1 with
``noeviction``: ``OOM``) or a replica of a primary that is not there (``READONLY``; stale reads
still served, so a ``PING`` answers): every route answers the queue's 503 in its own shape with
``Retry-After``, no worker is asked, the cause is logged, nothing is held; once Redis is itself
again, requests succeed without a restart. A request in flight when Redis turns read-only
finishes, and its slot (released while Redis refused: its lease expires with the TTL) and its key
slot (given back once Redis takes writes) are freed. ``SCRIPT FLUSH`` between requests is
invisible (redis-py loads a script again on ``NOSCRIPT``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.admission.connection import StoreRefused, StoreUnavailable, store_error
from gpupool.gateway.admission.redis_backend import RedisAdmission
from gpupool.gateway.api.app import create_app
from gpupool.gateway.services import Services, build_services
from gpupool.workers.registry import WorkerState
from tests.conftest import RedisServer
from tests.gateway.tenancy.fake_worker import FakeWorker
from tests.support.procs import free_port

MODEL = "m"
KEY, ADMIN = "sk-a-refusals", "sk-admin-refusals"
LEASE_TTL_S = 2.0
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/tokenize", {"prompt": "hi"}),
]
ANTHROPIC = {"/v1/messages"}


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class GatedWorker(FakeWorker):
    """The recording worker; while ``hold`` is set its answers wait for ``gate``."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.hold = False
        self.gate = threading.Event()
        self.arrived = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.hold and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            self.arrived.set()
            await asyncio.to_thread(self.gate.wait, 60)
        await super().__call__(scope, receive, send)


@dataclass
class Gateway:
    http: httpx.AsyncClient
    svc: Services
    worker: GatedWorker
    redis: Redis  # a client of the test's own, to make Redis sick and well

    async def call(self, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEY}"}
        return await self.http.post(path, json={"model": MODEL, **body}, headers=headers)

    async def held(self) -> dict[str, dict[str, int]]:
        r = await self.http.get("/admin/held", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        held: dict[str, dict[str, int]] = r.json()
        return held

    async def assert_nothing_held(self) -> None:
        """Nothing held, as this replica sees it now (Redis's view while Redis is up)."""
        held = await self.held()
        assert sum(sum(v.values()) for v in held.values()) == 0, held

    async def all_served(self) -> None:
        for path, body in ROUTES:
            r = await self.call(path, body)
            assert r.status_code == 200, (path, r.status_code, r.text)

    @property
    def admission(self) -> RedisAdmission:
        assert isinstance(self.svc.admission, RedisAdmission)
        return self.svc.admission


def _cfg(worker_url: str, redis_url: str, policy: str) -> GpupoolConfig:
    return GpupoolConfig.model_validate({
        "models": [{"name": MODEL}],
        "workers": [{"name": "w1", "model": MODEL, "url": worker_url}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "a", "sha256": _h(KEY), "tenant": "team-a",
                           "max_concurrent": 4, "rpm": 10_000, "tpm": 10_000_000}]},
        "queue": {"backend": "redis", "redis_url": redis_url, "lease_ttl_s": LEASE_TTL_S,
                  "on_redis_down": policy, "max_wait_s": 5},
    })  # fmt: skip


@asynccontextmanager
async def _gateway(server: RedisServer, policy: str) -> AsyncIterator[Gateway]:
    worker = GatedWorker(MODEL)
    redis = Redis.from_url(server.url, decode_responses=True)
    with worker.running():
        svc = build_services(_cfg(worker.url, server.url, policy))
        for w in svc.registry:
            w.set_state(WorkerState.ready)  # what the poller would do
        await svc.admission.start()
        app = create_app(svc.cfg, svc=svc)
        app.app.state.services = svc  # what the lifespan does
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(
                transport=transport, base_url="http://gw", timeout=60
            ) as c:
                yield Gateway(c, svc, worker, redis)
        finally:
            worker.gate.set()
            await svc.admission.close()
            await svc.key_limits.aclose()
            await svc.pipeline.stored.owners.aclose()
            await svc.client.close()
            await redis.aclose()


@pytest.fixture
async def gw(own_redis: RedisServer) -> AsyncIterator[Gateway]:
    async with _gateway(own_redis, "reject") as g:
        yield g


@asynccontextmanager
async def refusing(redis: Redis, how: str) -> AsyncIterator[None]:
    """Redis refusing writes, then itself again (also when the test fails): full
    (``maxmemory`` 1, ``noeviction``: ``OOM``) or a read-only replica of a primary that is not
    there (``READONLY``; reads still served, and ``PING``)."""
    sick = {"maxmemory-policy": "noeviction", "maxmemory": "1"}
    if how == "readonly":
        sick = {"replica-read-only": "yes", "replica-serve-stale-data": "yes"}
    saved: dict[str, str] = {}
    for name in sick:
        saved[name] = str((await redis.config_get(name))[name])
    for name, value in sick.items():
        await redis.config_set(name, value)
    if how == "readonly":
        await redis.replicaof("127.0.0.1", free_port())
    try:
        yield
    finally:
        if how == "readonly":
            await redis.replicaof("NO", "ONE")
        for name, value in reversed(saved.items()):  # maxmemory before its policy
            await redis.config_set(name, value)


async def _eventually(
    what: str, check: Callable[[], Awaitable[bool]], within_s: float = 60
) -> None:
    """Wait for ``check`` (a generous deadline: a hang guard, not a measurement)."""
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {within_s:g}s: {what}"
        await asyncio.sleep(0.1)


def _assert_unavailable(path: str, r: httpx.Response) -> None:
    assert r.status_code == 503, (path, r.status_code, r.text)
    assert int(r.headers["retry-after"]) >= 1, path
    body = r.json()
    if path in ANTHROPIC:
        assert body["type"] == "error", body
        error = body["error"]
    else:
        error = body["error"]
        assert error["code"] == 503, body
    assert error["type"] == "ServiceUnavailableError", body
    assert error["message"].startswith("Admission is unavailable"), body
    assert "127.0.0.1" not in r.text and "maxmemory" not in r.text and "READONLY" not in r.text


async def _served_again(gw: Gateway) -> None:
    async def serves() -> bool:
        r = await gw.call("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200

    await _eventually("requests served again", serves)
    await _eventually("admission back on Redis", lambda: _true(gw.admission.redis_up))
    await _eventually("limits back on Redis", lambda: _true(gw.svc.key_limits.redis_up))
    await gw.all_served()


async def _true(value: bool) -> bool:
    return value


async def _nothing_held_eventually(gw: Gateway) -> None:
    async def empty() -> bool:
        held = await gw.held()
        return sum(sum(v.values()) for v in held.values()) == 0

    await _eventually("nothing held", empty)


@pytest.mark.parametrize("how", ["oom", "readonly"])
async def test_a_refusing_redis_is_a_503_on_every_route_until_it_is_well(
    gw: Gateway, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    await gw.all_served()
    await gw.assert_nothing_held()
    seen = len(gw.worker.seen)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        async with refusing(gw.redis, how):
            for path, body in ROUTES:
                _assert_unavailable(path, await gw.call(path, body))
            assert len(gw.worker.seen) == seen  # no worker was asked
            assert not gw.admission.redis_up
            await gw.assert_nothing_held()
            await asyncio.sleep(LEASE_TTL_S)  # recovery attempts meanwhile: PING answers,
            assert not gw.admission.redis_up  # but the renewal's write is refused
            _assert_unavailable("/v1/messages", await gw.call(*ROUTES[4]))
    cause = "OutOfMemoryError" if how == "oom" else "ReadOnlyError"
    refused = [r.getMessage() for r in caplog.records if "Redis refused a call" in r.getMessage()]
    assert any("admission" in m and cause in m for m in refused), refused
    assert "Traceback" not in caplog.text
    await _served_again(gw)
    await _nothing_held_eventually(gw)


async def test_a_request_in_flight_when_redis_turns_read_only_frees_what_it_held(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    gw.worker.hold = True
    running = asyncio.ensure_future(gw.call("/v1/completions", {"prompt": "x", "max_tokens": 1}))
    await _eventually("the worker has it", lambda: _true(gw.worker.arrived.is_set()))
    held = await gw.held()
    assert held["slots"] == {"w1": 1} and held["key_slots"] == {"a": 1}, held
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        async with refusing(gw.redis, "readonly"):
            _assert_unavailable("/v1/chat/completions", await gw.call(*ROUTES[2]))
            gw.worker.gate.set()
            gw.worker.hold = False
            done = await running
            assert done.status_code == 200, done.text  # the answer made goes out
            await gw.assert_nothing_held()  # released here; Redis refused the release
            assert gw.svc.key_limits.holders() == set()
    assert "Traceback" not in caplog.text
    # the refused release's lease expires with its TTL; the key slot is given on recovery
    await _nothing_held_eventually(gw)
    await _served_again(gw)
    await _nothing_held_eventually(gw)


async def test_a_script_flush_between_requests_is_not_seen(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        for _ in range(3):
            await gw.all_served()
            assert await gw.redis.script_flush()
        await gw.all_served()
    assert gw.admission.redis_up and gw.svc.key_limits.redis_up
    assert "Redis" not in caplog.text
    await _nothing_held_eventually(gw)


async def test_the_local_policy_serves_while_redis_refuses(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async with _gateway(own_redis, "local") as gw:
        await gw.all_served()
        with caplog.at_level(logging.WARNING, logger="gpupool"):
            async with refusing(gw.redis, "oom"):
                await gw.all_served()  # on this replica's share of the worker
                # (the key's limits may still be shared: a script whose first write frees
                # memory, as the rpm window's trim, may write on in a full Redis)
                assert not gw.admission.redis_up
                await gw.assert_nothing_held()
        assert "Redis refused a call" in caplog.text and "Traceback" not in caplog.text
        await _served_again(gw)
        await _nothing_held_eventually(gw)


def test_a_state_reply_is_a_refusal_and_a_lost_connection_is_not() -> None:
    # (every reply: tests/gateway/admission/test_redis_call_errors.py)
    misconf = ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's ...")
    for exc in (misconf, OutOfMemoryError("command not allowed"), ResponseError("BUSY")):
        mapped = store_error(exc)
        assert isinstance(mapped, StoreRefused), exc
        assert type(exc).__name__ in str(mapped)
    for lost in (RedisConnectionError("reset"), TimeoutError(), ConnectionResetError()):
        mapped = store_error(lost)
        assert type(mapped) is StoreUnavailable, lost
