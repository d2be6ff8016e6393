"""The generated key of the tenants' cache salts: kept in a file under ``state_dir`` (memory
backend) or in Redis (redis backend), so every process that must agree on a salt does; this
process's own, and logged, while its store cannot be used."""

from __future__ import annotations

import hashlib
import logging
import stat
from pathlib import Path

import pytest

from gpupool.config.models import ApiKey, AuthConfig, QueueConfig, TenancyConfig
from gpupool.gateway.tenancy.secret import FILE, GeneratedSecret, build_scope
from tests.conftest import RedisServer
from tests.support.procs import free_port

MEMORY = QueueConfig()


def _key(name: str, tenant: str) -> ApiKey:
    return ApiKey(name=name, sha256=hashlib.sha256(name.encode()).hexdigest(), tenant=tenant)


TWO = AuthConfig(enabled=True, keys=[_key("a", "team-a"), _key("b", "t1")])  # no admin key


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _redis(url: str) -> QueueConfig:
    return QueueConfig(backend="redis", redis_url=url, lease_ttl_s=2.0)


async def test_processes_sharing_a_state_dir_share_the_secret(tmp_path: Path) -> None:
    one, two = GeneratedSecret(MEMORY, str(tmp_path)), GeneratedSecret(MEMORY, str(tmp_path))
    assert one.value != two.value  # each its own until settled
    assert await one.settle() == await two.settle() == one.value == two.value
    path = tmp_path / FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().strip() == one.value
    assert _names(tmp_path) == [FILE]  # no temporary file left
    later = GeneratedSecret(MEMORY, str(tmp_path))  # a restart
    assert await later.settle() == one.value


async def test_a_scope_keys_every_tenant_apart_with_the_kept_secret(tmp_path: Path) -> None:
    scopes = [await build_scope(TenancyConfig(), TWO, None, GeneratedSecret(MEMORY, str(tmp_path)))
              for _ in range(2)]  # fmt: skip
    assert all(s.isolated for s in scopes)
    assert scopes[0].salt("team-a") == scopes[1].salt("team-a") != scopes[0].salt("t1")


async def test_nothing_is_written_unless_the_generated_secret_is_used(tmp_path: Path) -> None:
    one_tenant = AuthConfig(enabled=True, keys=[_key("a", "team-a")])
    generated = GeneratedSecret(MEMORY, str(tmp_path))
    assert not (await build_scope(TenancyConfig(), one_tenant, None, generated)).isolated
    configured = TenancyConfig(cache="tenant", salt_secret="s3cret")
    assert (await build_scope(configured, TWO, None, generated)).isolated
    assert _names(tmp_path) == [] and not generated.settled


async def test_an_unusable_file_leaves_this_process_its_own_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / FILE).write_text("short\n")
    generated = GeneratedSecret(MEMORY, str(tmp_path))
    own = generated.value
    with caplog.at_level(logging.WARNING, "gpupool.tenancy"):
        assert await generated.settle() == own
    assert not generated.settled and "no usable secret" in caplog.text
    (tmp_path / FILE).unlink()  # the operator removes it; the next reload settles
    assert await generated.settle() == own and generated.settled


async def test_replicas_on_one_redis_share_the_secret(own_redis: RedisServer) -> None:
    queue = _redis(own_redis.url)
    one, two = GeneratedSecret(queue, None), GeneratedSecret(queue, None)
    assert await one.settle() == await two.settle() == one.value
    assert two.settled and len(two.value) == 64


async def test_redis_down_leaves_this_process_its_own_until_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer()
    server.port = free_port()
    generated = GeneratedSecret(_redis(server.url), None)
    own = generated.value
    with caplog.at_level(logging.WARNING, "gpupool.tenancy"):
        assert await generated.settle() == own
    assert not generated.settled and "Redis unusable" in caplog.text
    other = GeneratedSecret(_redis(server.url), None)
    await server.astart()
    try:
        first = await other.settle()  # another replica stored its own meanwhile
        assert await generated.settle() == first and generated.settled
    finally:
        await server.akill()
