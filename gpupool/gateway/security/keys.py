"""API keys: stored as SHA-256 hashes, looked up by the hash of what a client presents.

Looking a key up by its SHA-256 never compares secret bytes directly, so the lookup's timing
says nothing about the key; the final match is confirmed with ``hmac.compare_digest``. Keys are
never logged: only their configured names are.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from gpupool.config.models import ApiKey, AuthConfig


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a client key (with its policy) or the admin."""

    name: str
    tenant: str
    admin: bool = False
    key: ApiKey | None = None


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def load_keys_file(path: str) -> list[ApiKey]:
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    items = data.get("keys", []) if isinstance(data, dict) else data
    try:
        return TypeAdapter(list[ApiKey]).validate_python(items)
    except ValidationError as e:
        raise ValueError(f"{path}: invalid keys file: {e}") from None


def all_keys(cfg: AuthConfig) -> list[ApiKey]:
    """The client keys: those in the config and those in its ``keys_file``."""
    keys = list(cfg.keys)
    if cfg.keys_file:
        keys += load_keys_file(cfg.keys_file)
    return keys


def key_name(key: ApiKey) -> str:
    """The name a key's limits and logs go by (its ``name``, or its hash's first 8 digits)."""
    return key.name or key.sha256.lower()[:8]


class KeyStore:
    def __init__(self, cfg: AuthConfig) -> None:
        keys = all_keys(cfg)
        self._by_hash = {k.sha256.lower(): k for k in keys}
        self._admin = cfg.admin_key_sha256.lower() if cfg.admin_key_sha256 else None

    def identify(self, secret: str) -> Principal | None:
        digest = hash_key(secret)
        if self._admin is not None and hmac.compare_digest(digest, self._admin):
            return Principal("admin", "admin", admin=True)
        key = self._by_hash.get(digest)
        if key is None or not hmac.compare_digest(digest, key.sha256.lower()):
            return None
        name = key_name(key)
        return Principal(name, key.tenant or name, key=key)


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key from ``Authorization: Bearer …`` or ``x-api-key``."""
    for k, v in headers:
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif k == b"x-api-key" and v:
            return v.decode("latin-1").strip()
    return None
