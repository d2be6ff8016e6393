"""API keys: stored as SHA-256 hashes, looked up by the hash of what a client presents.

Looking a key up by its SHA-256 never compares secret bytes directly, so the lookup's timing
says nothing about the key; the final match is confirmed with ``hmac.compare_digest``. Keys are
never logged: only their configured names are.

A :class:`KeyStore` is an immutable snapshot of the keys of one configuration (its ``keys`` and
its ``keys_file``); a reload builds a new one and the authenticator swaps it in whole. A keys
file that cannot be read or has an invalid entry raises :class:`KeysFileError`, whose message
names the file and the line.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from gpupool.config.load import duplicate_keys, line_of
from gpupool.config.models import ApiKey, AuthConfig


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a client key (with its policy) or the admin."""

    name: str
    tenant: str
    admin: bool = False
    key: ApiKey | None = None


class KeysFileError(ValueError):
    """The keys file is unreadable or invalid; ``str()`` is ``<file>:<line>: <problem>``."""


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when built with it: ~10x


def load_keys_file(path: str) -> list[ApiKey]:
    """The keys of a keys file (a ``keys:`` list, or a bare list), each entry validated."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise KeysFileError(f"{path}: cannot read the keys file: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_LOADER) or {}
        twice = duplicate_keys(yaml.compose(text, Loader=_LOADER))  # a second `models:`...
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise KeysFileError(f"{path}{at}: not valid YAML: {e}") from None
    if twice:
        line, problem = twice[0]
        raise KeysFileError(f"{path}:{line}: {problem} ({len(twice)} problem(s) in all)")
    items = data.get("keys", []) if isinstance(data, dict) else data
    try:
        return TypeAdapter(list[ApiKey]).validate_python(items)
    except ValidationError as e:
        first = e.errors()[0]
        loc = tuple(first["loc"])
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # again, for the lines: only on errors
        if isinstance(data, dict) and isinstance(root, yaml.MappingNode):
            root = next((v for k, v in root.value if k.value == "keys"), root)
        line = line_of(root, loc)
        where = "keys" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        raise KeysFileError(
            f"{path}:{line}: {where}: {first['msg']} ({e.error_count()} problem(s) in all)"
        ) from None


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
    """The keys of one configuration, by hash; never changed once built."""

    def __init__(self, cfg: AuthConfig, keys: list[ApiKey] | None = None) -> None:
        keys = all_keys(cfg) if keys is None else keys
        self._by_hash: dict[str, ApiKey] = {}
        for k in keys:
            digest = k.sha256.lower()
            if digest in self._by_hash:
                where = f"{cfg.keys_file}: " if cfg.keys_file else ""
                raise KeysFileError(
                    f"{where}keys `{key_name(self._by_hash[digest])}` and `{key_name(k)}` "
                    "have the same sha256"
                )
            self._by_hash[digest] = k
        self._admin = cfg.admin_key_sha256.lower() if cfg.admin_key_sha256 else None

    @property
    def keys(self) -> dict[str, ApiKey]:
        """Every client key, by its lower-case hash."""
        return dict(self._by_hash)

    @property
    def admin_hash(self) -> str | None:
        return self._admin

    def knows(self, key: ApiKey) -> bool:
        """Whether ``key`` (by its hash) is still one of this store's keys."""
        return key.sha256.lower() in self._by_hash

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
