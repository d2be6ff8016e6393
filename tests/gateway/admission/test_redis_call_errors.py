"""One Redis call rejected while Redis is well fails that request only, through the front door.

The gateway's app (``create_app``) in-process over ASGI, two recording workers (``w1`` serves
model ``m``, ``w2`` model ``m2``), two keys (``a``, ``b``), ``queue.backend: redis`` on a real
``redis-server``, policy ``reject`` (an outage would answer every request 503). One key the
scripts use is replaced with a value of another type (``WRONGTYPE`` inside the script, after it
has written part of its work), then restored:

* admission's drain rate of ``m`` (``rate:m``): written after the grant took the slot, so the
  failed acquire holds a slot in Redis until it is withdrawn;
* key ``a``'s token charges (``kl:ta:a``): written after the take recorded the key slot.

The request that hits it gets a 503 in its route's shape (no worker asked), the traceback is
logged, Redis is not marked down (requests on clean keys keep being served through Redis), nothing
stays held, and once the key is restored the same request succeeds. Also: which error replies are
an outage (``store_error``'s classification).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    DataError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.admission.connection import (
    StoreFailed,
    StoreRefused,
    StoreUnavailable,
    store_error,
)
from gpupool.gateway.admission.redis_backend import RedisAdmission
from gpupool.gateway.api.app import create_app
from gpupool.gateway.services import Services, build_services
from gpupool.workers.registry import WorkerState
from tests.conftest import RedisServer
from tests.gateway.tenancy.fake_worker import FakeWorker

KEY_A, KEY_B, ADMIN = "sk-a-call-errors", "sk-b-call-errors", "sk-admin-call-errors"
PREFIX = "gpupool"
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
]
ANTHROPIC = {"/v1/messages"}


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Gateway:
    http: httpx.AsyncClient
    svc: Services
    workers: dict[str, FakeWorker]  # by model
    redis: Redis  # the test's own client, to break a key and restore it

    async def call(
        self, model: str, key: str, path: str = ROUTES[0][0], body: dict[str, Any] | None = None
    ) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"}
        payload = {"model": model, **(ROUTES[0][1] if body is None else body)}
        return await self.http.post(path, json=payload, headers=headers)

    async def assert_nothing_held(self) -> None:
        r = await self.http.get("/admin/held", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        held = r.json()
        assert sum(sum(v.values()) for v in held.values()) == 0, held
        assert self.svc.key_limits.holders() == set()

    def assert_redis_in_use(self) -> None:
        assert isinstance(self.svc.admission, RedisAdmission)
        assert self.svc.admission.redis_up, "admission went into outage mode"
        assert self.svc.key_limits.redis_up, "the key limits went into outage mode"


def _cfg(urls: dict[str, str], redis_url: str) -> GpupoolConfig:
    limits = {"max_concurrent": 4, "rpm": 10_000, "tpm": 10_000_000}
    return GpupoolConfig.model_validate({
        "models": [{"name": "m"}, {"name": "m2"}],
        "workers": [{"name": "w1", "model": "m", "url": urls["m"]},
                    {"name": "w2", "model": "m2", "url": urls["m2"]}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "a", "sha256": _h(KEY_A), "tenant": "team-a", **limits},
                          {"name": "b", "sha256": _h(KEY_B), "tenant": "team-b", **limits}]},
        "queue": {"backend": "redis", "redis_url": redis_url, "redis_prefix": PREFIX,
                  "lease_ttl_s": 2.0, "on_redis_down": "reject", "max_wait_s": 5},
    })  # fmt: skip


@pytest.fixture
async def gw(own_redis: RedisServer) -> AsyncIterator[Gateway]:
    workers = {"m": FakeWorker("m"), "m2": FakeWorker("m2")}
    redis = Redis.from_url(own_redis.url, decode_responses=True)
    with ExitStack() as stack:
        for worker in workers.values():
            stack.enter_context(worker.running())
        svc = build_services(_cfg({m: w.url for m, w in workers.items()}, own_redis.url))
        for w in svc.registry:
            w.set_state(WorkerState.ready)  # what the poller would do
        await svc.admission.start()
        app = create_app(svc.cfg, svc=svc)
        app.app.state.services = svc  # what the lifespan does
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60
            ) as c:
                yield Gateway(c, svc, workers, redis)
        finally:
            await svc.admission.close()
            await svc.key_limits.aclose()
            await svc.pipeline.stored.owners.aclose()
            await svc.client.close()
            await redis.aclose()


@asynccontextmanager
async def wrong_type(redis: Redis, key: str) -> AsyncIterator[None]:
    """``key`` (a hash the scripts use) holds a string meanwhile; restored also on failure."""
    saved = await redis.hgetall(key)
    assert saved, f"{key} should exist before it is broken"
    await redis.set(key, "not a hash")
    try:
        yield
    finally:
        await redis.delete(key)
        await redis.hset(key, mapping={str(k): str(v) for k, v in saved.items()})


def _assert_failed_here(path: str, r: httpx.Response, message: str) -> None:
    assert r.status_code == 503, (path, r.status_code, r.text)
    body = r.json()
    if path in ANTHROPIC:
        assert body["type"] == "error", body
    else:
        assert body["error"]["code"] == 503, body
    assert body["error"]["type"] == "ServiceUnavailableError", body
    assert body["error"]["message"].startswith(message), body
    assert "WRONGTYPE" not in r.text and "script" not in r.text and "127.0.0.1" not in r.text


def _assert_logged_with_traceback(caplog: pytest.LogCaptureFixture, logger: str) -> None:
    failed = [r for r in caplog.records if r.name.startswith(logger) and r.exc_info]
    assert failed, caplog.text
    assert "WRONGTYPE" in caplog.text, caplog.text
    assert "refused a call" not in caplog.text and "unreachable" not in caplog.text


async def test_a_rejected_admission_call_fails_that_request_only(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    for model in ("m", "m2"):
        assert (await gw.call(model, KEY_A)).status_code == 200
    seen = len(gw.workers["m"].seen)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        async with wrong_type(gw.redis, f"{PREFIX}:rate:m"):
            for path, body in ROUTES:
                r = await gw.call("m", KEY_A, path, body)
                _assert_failed_here(path, r, "Admission failed for this request")
                # the slot the script took before its error was released at once
                assert await gw.redis.zcard(f"{PREFIX}:s:w1") == 0
            assert len(gw.workers["m"].seen) == seen  # no worker was asked
            gw.assert_redis_in_use()
            await gw.assert_nothing_held()
            # other requests keep being served, through Redis (the grant ticks m2's rate)
            before = await gw.redis.hget(f"{PREFIX}:rate:m2", "t")
            await asyncio.sleep(0.01)  # a grant in another millisecond
            for key in (KEY_A, KEY_B):
                r = await gw.call("m2", key)
                assert r.status_code == 200, r.text
            assert await gw.redis.hget(f"{PREFIX}:rate:m2", "t") != before
            gw.assert_redis_in_use()
    _assert_logged_with_traceback(caplog, "gpupool.gateway.admission")
    for path, body in ROUTES:  # the key restored: served again, no restart
        r = await gw.call("m", KEY_A, path, body)
        assert r.status_code == 200, (path, r.text)
    gw.assert_redis_in_use()
    await gw.assert_nothing_held()


async def test_a_rejected_key_limits_call_fails_that_request_only(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    for key in (KEY_A, KEY_B):
        assert (await gw.call("m", key)).status_code == 200
    seen = len(gw.workers["m"].seen)
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        async with wrong_type(gw.redis, f"{PREFIX}:kl:ta:a"):
            for path, body in ROUTES:
                r = await gw.call("m", KEY_A, path, body)
                _assert_failed_here(path, r, "Key `a`'s limits could not be checked")
                # the key slot the script recorded before its error was given back at once
                assert await gw.redis.zcard(f"{PREFIX}:kl:c:a") == 0
            assert len(gw.workers["m"].seen) == seen  # no worker was asked
            gw.assert_redis_in_use()
            await gw.assert_nothing_held()
            # key b's requests keep being counted in Redis (its minute's requests grow)
            before = await gw.redis.zcard(f"{PREFIX}:kl:r:b")
            for model in ("m", "m2"):
                r = await gw.call(model, KEY_B)
                assert r.status_code == 200, r.text
            assert await gw.redis.zcard(f"{PREFIX}:kl:r:b") == before + 2
            gw.assert_redis_in_use()
    _assert_logged_with_traceback(caplog, "gpupool.limits")
    for path, body in ROUTES:  # the key restored: served again, no restart
        r = await gw.call("m", KEY_A, path, body)
        assert r.status_code == 200, (path, r.text)
    gw.assert_redis_in_use()
    await gw.assert_nothing_held()


@pytest.mark.parametrize(
    "exc",
    [
        OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        ReadOnlyError("You can't write against a read only replica."),
        BusyLoadingError("Redis is loading the dataset in memory"),
        ClusterDownError("The cluster is down"),
        MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
        TryAgainError("Multiple keys request during rehashing of slot"),
        ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's ..."),
        ResponseError("NOREPLICAS Not enough good replicas to write."),
        ResponseError("BUSY Redis is busy running a script."),
        ResponseError("OOM command not allowed when used memory > 'maxmemory'. script: ..."),
        ResponseError("READONLY You can't write against a read only replica. script: ..."),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e).split()[0]}",
)
def test_a_server_state_reply_is_an_outage(exc: Exception) -> None:
    mapped = store_error(exc)
    assert isinstance(mapped, StoreRefused), exc
    assert type(exc).__name__ in str(mapped)


@pytest.mark.parametrize(
    "exc",
    [
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        ResponseError("ERR user_script:1: Script attempted to access nonexistent global variable"),
        ResponseError("ERR value is not an integer or out of range"),
        ResponseError("BUSYKEY Target key name already exists."),  # not BUSY
        ResponseError("BUSYGROUP Consumer Group name already exists"),
        ResponseError(""),
        NoScriptError("No matching script."),  # redis-py's Script reloads it; if one escapes
        DataError("Invalid input of type: 'NoneType'."),
    ],
    ids=lambda e: f"{type(e).__name__}:{(str(e).split() or [''])[0]}",
)
def test_any_other_reply_fails_the_call_only(exc: Exception) -> None:
    mapped = store_error(exc)
    assert isinstance(mapped, StoreFailed), exc
    assert not isinstance(mapped, StoreUnavailable)  # no outage handler takes it for one


@pytest.mark.parametrize(
    "exc", [RedisConnectionError("reset"), RedisTimeoutError(), TimeoutError(), OSError()]
)
def test_a_lost_connection_is_for_the_probe(exc: Exception) -> None:
    assert type(store_error(exc)) is StoreUnavailable
