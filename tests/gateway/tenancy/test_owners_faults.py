"""Stored responses whose owners live in a sick Redis, through the real front door.

The gateway's app (``create_app``) in-process over ASGI, a recording worker on a loopback port
and a real ``redis-server`` holding the owners of stored responses (``tenancy/owners.py``).
Admission stays in memory here, so what is seen is the owners' store alone. Redis hung
(SIGSTOP), full (``OOM``) or a replica cut off from its primary (``READONLY``, ``MASTERDOWN``):
a lookup it cannot answer is a 503 in the route's envelope, never a 500 nor a false 404; a
write it refuses is logged and the answer still goes out. Nothing is held afterwards, and
another tenant's requests go on meanwhile and after.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gpupool.config.models import GpupoolConfig, QueueConfig
from gpupool.gateway.api.app import create_app
from gpupool.gateway.services import Services, build_services
from gpupool.gateway.tenancy.owners import RedisOwners, build_owners
from gpupool.workers.registry import WorkerState
from tests.conftest import RedisServer
from tests.gateway.tenancy.fake_worker import FakeWorker
from tests.gateway.tenancy.test_owners import refusing, stopped

MODEL = "m"
A, B, ADMIN = "sk-a-owners", "sk-b-owners", "sk-admin-owners"


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cfg(worker_url: str) -> GpupoolConfig:
    return GpupoolConfig.model_validate({
        "models": [{"name": MODEL}],
        "workers": [{"name": "w1", "model": MODEL, "url": worker_url}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "a", "sha256": _h(A), "tenant": "team-a"},
                          {"name": "b", "sha256": _h(B), "tenant": "t1"}]},
    })  # fmt: skip


@dataclass
class Gateway:
    http: httpx.AsyncClient
    svc: Services
    owners: RedisOwners
    worker: FakeWorker
    redis: RedisServer

    async def call(self, method: str, path: str, key: str, body: Any = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"}
        return await self.http.request(method, path, json=body, headers=headers)

    async def made_elsewhere(self) -> str:
        """A response of team-a's that only Redis knows of (as one made through another
        replica): this replica's memory copy forgotten."""
        r = await self.call("POST", "/v1/responses", A, {"model": MODEL, "input": "x"})
        assert r.status_code == 200, r.text
        rid: str = r.json()["id"]
        await self.owners.local.forget(rid)
        return rid

    async def others_unaffected(self) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        r = await self.call("POST", "/v1/completions", B, body)
        assert r.status_code == 200, r.text

    async def assert_nothing_held(self) -> None:
        r = await self.call("GET", "/admin/held", ADMIN)
        held = r.json()
        assert sum(sum(int(v) for v in part.values()) for part in held.values()) == 0, held


@pytest.fixture
async def gw(own_redis: RedisServer) -> AsyncIterator[Gateway]:
    worker = FakeWorker(MODEL)
    with worker.running():
        cfg = _cfg(worker.url)
        svc = build_services(cfg)
        for w in svc.registry:
            w.set_state(WorkerState.ready)  # what the poller would do
        queue = QueueConfig(backend="redis", redis_url=own_redis.url, lease_ttl_s=2)
        owners = build_owners(cfg.tenancy, queue)
        assert isinstance(owners, RedisOwners)
        svc.pipeline.stored.owners = owners
        app = create_app(cfg, svc=svc)
        app.app.state.services = svc  # what the lifespan does
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as c:
            yield Gateway(c, svc, owners, worker, own_redis)
        await owners.aclose()
        await svc.client.close()


def _assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert error["message"].startswith("Stored responses cannot be looked up right now")
    assert "127.0.0.1" not in r.text and "redis" not in r.text.lower()


async def test_a_hung_redis_is_a_503_and_this_replicas_own_still_work(
    gw: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = await gw.made_elsewhere()
    r = await gw.call("POST", "/v1/responses", A, {"model": MODEL, "input": "mine"})
    mine = r.json()["id"]
    seen = len(gw.worker.seen)
    with stopped(gw.redis), caplog.at_level(logging.WARNING, logger="gpupool"):
        async with asyncio.timeout(120):  # a hang guard, not a measurement
            answers = await asyncio.gather(
                *(gw.call("GET", f"/v1/responses/{elsewhere}", A) for _ in range(20))
            )
            for answer in answers:
                _assert_unavailable(answer)
            follow = {"model": MODEL, "input": "y", "previous_response_id": elsewhere}
            _assert_unavailable(await gw.call("POST", "/v1/responses", A, follow))
            assert len(gw.worker.seen) == seen  # no worker was asked
            assert (await gw.call("GET", f"/v1/responses/{mine}", A)).status_code == 200
            made = await gw.call("POST", "/v1/responses", A, {"model": MODEL, "input": "z"})
            assert made.status_code == 200  # its owner kept in this replica's memory, logged
            await gw.others_unaffected()
            await gw.assert_nothing_held()
    assert "not looked up, Redis failed" in caplog.text
    assert "not written to Redis" in caplog.text
    assert (await gw.call("GET", f"/v1/responses/{elsewhere}", A)).status_code == 200
    assert (await gw.call("GET", f"/v1/responses/{elsewhere}", B)).status_code == 404
    await gw.others_unaffected()
    await gw.assert_nothing_held()


@pytest.mark.parametrize("refusal", ["oom", "readonly"])
async def test_a_redis_refusing_writes_never_makes_a_500(
    gw: Gateway, caplog: pytest.LogCaptureFixture, refusal: str
) -> None:
    elsewhere = await gw.made_elsewhere()
    redis = gw.owners.redis
    async with refusing(redis, refusal):
        with caplog.at_level(logging.WARNING, logger="gpupool"):
            made = await gw.call("POST", "/v1/responses", A, {"model": MODEL, "input": "x"})
            assert made.status_code == 200, made.text  # the answer goes out; logged
            mine = made.json()["id"]
            assert (await gw.call("GET", f"/v1/responses/{mine}", A)).status_code == 200
            r = await gw.call("GET", f"/v1/responses/{elsewhere}", A)
            if refusal == "oom":
                assert r.status_code == 200  # a full Redis still answers reads
            else:
                _assert_unavailable(r)  # a cut-off replica answers nothing (MASTERDOWN)
            assert (await gw.call("DELETE", f"/v1/responses/{mine}", A)).status_code == 200
            await gw.others_unaffected()
            await gw.assert_nothing_held()
    assert "not written to Redis" in caplog.text
    assert (await gw.call("GET", f"/v1/responses/{elsewhere}", A)).status_code == 200
    await gw.others_unaffected()
    await gw.assert_nothing_held()
