"""The secret keying the tenants' cache salts when the configuration names none.

``tenancy.salt_secret`` wins, then one derived from ``auth.admin_key_sha256``
(``cache.configured_secret``). Without either the gateway makes one, and keeps it where every
process that must agree on it finds it: a tenant's salt (so its warm prefix cache on the
workers) must not change at a reload or a restart, nor from one replica to the next behind a
load balancer.

* ``queue.backend: redis`` (the replicas share Redis): ``SET <prefix>:cache-salt-secret NX``,
  then read back, so the first replica's secret becomes everyone's;
* ``memory``: ``<server.state_dir>/cache-salt-secret`` (mode 0600), made once with an atomic
  link, so two processes sharing the directory agree on the first one written;
* Redis unreachable, the file unusable (logged): this process's own until the next reload tries
  again. A reload never gives up a secret it has: salts change only when that retry succeeds.

Nothing is written until a scope needs the generated secret (tenants isolated, no configured
secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from redis.exceptions import RedisError

from gpupool.config.models import ApiKey, AuthConfig, QueueBackend, QueueConfig, TenancyConfig
from gpupool.gateway.admission.connection import CONNECTION_ERRORS, redis_client
from gpupool.gateway.tenancy.cache import CacheScope, configured_secret, isolates

log = logging.getLogger("gpupool.tenancy")

FILE = "cache-salt-secret"
_MIN_CHARS = 32  # a shorter stored value (someone else's, or cut) is not trusted as a key


class GeneratedSecret:
    """This gateway's generated secret: its own random one until :meth:`settle` finds (or
    stores) the shared one; then it stays for the life of the process."""

    def __init__(self, queue: QueueConfig, state_dir: str | None) -> None:
        self._queue = queue
        self._state_dir = state_dir
        self.value = secrets.token_hex(32).encode()
        self.settled = False

    async def settle(self) -> bytes:
        """The shared secret (once found, never looked up again); this process's own while
        its store cannot be used."""
        if not self.settled:
            found = await self._shared()
            if found is not None:
                self.value, self.settled = found, True
        return self.value

    async def _shared(self) -> bytes | None:
        if self._queue.backend is QueueBackend.redis:
            return await self._from_redis()
        if self._state_dir:
            return await asyncio.to_thread(self._from_file, Path(self._state_dir) / FILE)
        return self.value  # nowhere to keep it: this process's, for its whole life

    async def _from_redis(self) -> bytes | None:
        q = self._queue
        key = f"{q.redis_prefix}:{FILE}"
        client = redis_client(q.redis_url, q.lease_ttl_s, max_connections=2)
        try:
            await client.set(key, self.value.decode(), nx=True)
            stored = await client.get(key)
        except (*CONNECTION_ERRORS, RedisError) as e:
            log.warning("cache salt secret: Redis unusable (%s); this gateway's own until the "
                        "next reload, so replicas do not share prefix caches", e)  # fmt: skip
            return None
        finally:
            await client.aclose()
        if not isinstance(stored, str) or len(stored) < _MIN_CHARS:
            log.warning("cache salt secret: Redis key %s holds no usable secret (under %d "
                        "characters); delete it, or set tenancy.salt_secret",
                        key, _MIN_CHARS)  # fmt: skip
            return None
        return stored.encode()

    def _from_file(self, path: Path) -> bytes | None:
        try:
            if not path.exists():
                _create(path, self.value)
            stored = path.read_bytes().strip()
        except OSError as e:
            log.warning("cache salt secret: %s unusable (%s); this gateway's own until the "
                        "next reload", path, e)  # fmt: skip
            return None
        if len(stored) < _MIN_CHARS:
            log.warning("cache salt secret: %s holds no usable secret (under %d characters); "
                        "delete it, or set tenancy.salt_secret", path, _MIN_CHARS)  # fmt: skip
            return None
        return stored


def _create(path: Path, value: bytes) -> None:
    """Write ``value`` to ``path`` (0600) unless another process got there first: written to a
    file of its own, then linked into place, so no reader ever sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value + b"\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another gateway's came first: it wins
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


async def build_scope(
    tenancy: TenancyConfig,
    auth: AuthConfig,
    keys: Iterable[ApiKey] | None,
    generated: GeneratedSecret,
) -> CacheScope:
    """The cache scope for these settings, settling the generated secret first when it is the
    one that keys the salts."""
    keys = None if keys is None else list(keys)
    isolated = isolates(tenancy, auth, keys)
    secret = configured_secret(tenancy, auth)
    if secret is None:
        secret = await generated.settle() if isolated else generated.value
    return CacheScope(isolated, secret)
