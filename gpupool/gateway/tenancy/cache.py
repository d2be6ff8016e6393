"""Prefix-cache isolation between tenants.

vLLM's prefix cache is shared by every request on a worker: a prompt that starts like an earlier
one reuses its KV blocks and its first token comes sooner. Across tenants that is a side channel
(the time to first token tells one tenant what another sent), so when tenants are isolated:

* every request on a route that takes vLLM's ``cache_salt`` gets one derived from its tenant,
  ``HMAC-SHA256(secret, tenant)`` in base64url (43 characters, no ``/``, ``@`` or ``\\``): the
  same tenant's requests still share blocks, another tenant's never match them;
* a client's own ``cache_salt`` is mixed in (``HMAC(secret, tenant NUL salt)``) rather than
  refused: vLLM documents it for isolating users *within* a deployment, which stays possible,
  and no salt a client picks can name another tenant's cache;
* the prefix-affinity key names the tenant (:meth:`CacheScope.owner`), so the router no longer
  sends a tenant to the worker holding another tenant's prefix.

``tenancy.cache: shared`` turns all of it off (one organisation sharing its cache on purpose);
``auto`` isolates when auth is on and its keys name more than one tenant; a reload that adds or
removes tenants (or changes ``tenancy.cache`` or ``salt_secret``) decides again. Without a
configured secret the gateway generates one and keeps it for reloads and replicas (``secret.py``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable

from gpupool.config.models import ApiKey, AuthConfig, CacheSharing, TenancyConfig
from gpupool.gateway.errors import InvalidBody

# vLLM's own rule for a cache salt (generate/base/protocol.py ``validate_cache_salt``)
_MAX_SALT = 128
_FORBIDDEN = frozenset("@/\\\x00")


def tenants_of(auth: AuthConfig, keys: Iterable[ApiKey] | None = None) -> set[str]:
    """The tenants the client keys name (a key's tenant, else its name): ``keys`` as loaded,
    else the config's and its keys file's."""
    from gpupool.gateway.security.keys import all_keys, key_name

    if keys is None:
        try:
            keys = all_keys(auth)
        except (OSError, ValueError):
            keys = auth.keys
    return {k.tenant or key_name(k) for k in keys}


class CacheScope:
    """Whose prefix cache a request may use: its tenant's, or everyone's."""

    __slots__ = ("_key", "_salts", "isolated")

    def __init__(self, isolated: bool, secret: bytes) -> None:
        self.isolated = isolated
        self._key = secret
        self._salts: dict[str, str] = {}

    @classmethod
    def from_config(
        cls,
        tenancy: TenancyConfig,
        auth: AuthConfig,
        keys: Iterable[ApiKey] | None = None,
        generated: bytes | None = None,
    ) -> CacheScope:
        """As configured; ``keys``: the client keys already loaded (a reload's), if any;
        ``generated``: the secret when the config names none (``secret.py`` keeps one that
        reloads and replicas share; without it, a random one of this scope's own)."""
        secret = configured_secret(tenancy, auth) or generated or secrets.token_bytes(32)
        return cls(isolates(tenancy, auth, keys), secret)

    def owner(self, tenant: str) -> str | None:
        """The name prefix-affinity keys carry: the tenant when isolated, else None."""
        return tenant if self.isolated else None

    def salt(self, tenant: str, client_salt: object = None) -> str | None:
        """The ``cache_salt`` the worker sees, or None to leave the body as it is (shared)."""
        if not self.isolated:
            return None
        if client_salt is None:
            salt = self._salts.get(tenant)
            if salt is None:
                if len(self._salts) > 4096:
                    self._salts.clear()
                salt = self._salts[tenant] = self._digest(tenant.encode())
            return salt
        check_client_salt(client_salt)
        assert isinstance(client_salt, str)
        return self._digest(tenant.encode() + b"\0" + client_salt.encode())

    def _digest(self, message: bytes) -> str:
        mac = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def check_client_salt(value: object) -> None:
    """vLLM's 400 for a salt it would refuse (the mixed one would hide the mistake)."""
    if not isinstance(value, str) or not value:
        raise InvalidBody(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    if len(value) > _MAX_SALT or any(c in _FORBIDDEN for c in value):
        raise InvalidBody(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            param="cache_salt",
        )


def isolates(tenancy: TenancyConfig, auth: AuthConfig, keys: Iterable[ApiKey] | None) -> bool:
    """Whether each tenant gets a prefix cache of its own under these settings."""
    if tenancy.cache is CacheSharing.shared:
        return False
    if tenancy.cache is CacheSharing.tenant:
        return True
    return auth.enabled and len(tenants_of(auth, keys)) > 1


def configured_secret(tenancy: TenancyConfig, auth: AuthConfig) -> bytes | None:
    """The salts' key the config gives (``salt_secret``, else derived from the admin key's
    hash); None when the gateway must generate one (``secret.py``)."""
    if tenancy.salt_secret:
        return tenancy.salt_secret.encode()
    if auth.admin_key_sha256:
        admin = auth.admin_key_sha256.lower().encode()
        return hashlib.sha256(b"gpupool cache salt\0" + admin).digest()
    return None
