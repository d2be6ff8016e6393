"""Whose prefix cache a request may use: the decision, the salt, the affinity key."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from gpupool.config.models import ApiKey, AuthConfig, TenancyConfig
from gpupool.gateway.errors import InvalidBody
from gpupool.gateway.parse import owned_prefix_key
from gpupool.gateway.pipeline.pipeline import _splice
from gpupool.gateway.tenancy.cache import CacheScope


def _key(name: str, tenant: str | None = None) -> ApiKey:
    return ApiKey(name=name, sha256=hashlib.sha256(name.encode()).hexdigest(), tenant=tenant)


def _auth(*keys: ApiKey, enabled: bool = True) -> AuthConfig:
    return AuthConfig(enabled=enabled, keys=list(keys), admin_key_sha256="ab" * 32)


TWO = _auth(_key("a1", "team-a"), _key("a2", "team-a"), _key("b", "t1"))


@pytest.mark.parametrize(
    ("cache", "auth", "isolated"),
    [
        ("auto", TWO, True),
        ("auto", _auth(_key("a1", "team-a"), _key("a2", "team-a")), False),  # one tenant
        ("auto", _auth(_key("a"), _key("b")), True),  # no tenant: each key its own
        ("auto", _auth(_key("a", "x"), _key("b", "y"), enabled=False), False),  # no auth
        ("shared", TWO, False),  # one organisation, on purpose
        ("tenant", _auth(enabled=False), True),
    ],
)
def test_isolated_by_default_when_more_than_one_tenant_exists(
    cache: str, auth: AuthConfig, isolated: bool
) -> None:
    scope = CacheScope.from_config(TenancyConfig(cache=cache), auth)
    assert scope.isolated is isolated
    assert (scope.salt("team-a") is not None) is isolated
    assert (scope.owner("team-a") == "team-a") is isolated


def test_a_salt_is_a_keyed_hash_the_same_on_every_replica() -> None:
    one = CacheScope.from_config(TenancyConfig(), TWO)
    two = CacheScope.from_config(TenancyConfig(), TWO)  # another replica, same config
    other = CacheScope.from_config(TenancyConfig(salt_secret="s3cret"), TWO)
    assert one.salt("team-a") == two.salt("team-a") != other.salt("team-a")
    assert one.salt("team-a") != one.salt("t1")
    salt = one.salt("team-a")
    assert salt is not None and len(salt) == 43 and "team" not in salt
    assert not set(salt) & set("@/\\\0")


def test_a_client_salt_is_mixed_in_never_passed_as_is() -> None:
    scope = CacheScope.from_config(TenancyConfig(), TWO)
    assert scope.salt("team-a", "u1") not in (scope.salt("team-a"), "u1", scope.salt("t1", "u1"))
    for bad in ("", "a@b", "x" * 129, 3, ["x"]):
        with pytest.raises(InvalidBody):
            scope.salt("team-a", bad)


def test_the_affinity_key_names_its_tenant() -> None:
    key = hash(("system", "hello"))
    assert owned_prefix_key(key, "team-a") != owned_prefix_key(key, "t1")
    assert owned_prefix_key(key, "team-a") == owned_prefix_key(key, "team-a")
    assert owned_prefix_key(key, None) == key and owned_prefix_key(None, "t1") is None


@pytest.mark.parametrize("raw", [b'{"model":"m"}', b' {\n "a": [1, {"b": 2}]}', b"{}", b"{ }"])
def test_spliced_fields_make_the_same_object(raw: bytes) -> None:
    fields = {"cache_salt": "abc", "request_id": "resp_1"}
    assert orjson.loads(_splice(raw, fields)) == {**fields, **orjson.loads(raw)}
