"""Authentication as pure ASGI middleware: 401 without a valid key, 403 for the wrong kind.

``/health`` is always open, ``/metrics`` when the config says so; ``/admin/*`` needs the admin
key; every other route needs a client key (or the admin key). The token-bearing routes are
checked by the front door (``gateway/api/front.py``) with the same :class:`Authenticator`, which
also hands the caller's identity to their handlers.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gpupool.config.models import AuthConfig
from gpupool.gateway.api.errors import reject
from gpupool.gateway.errors import Forbidden, GatewayError, Unauthorized
from gpupool.gateway.security.keys import KeyStore, Principal, presented_key

_ALWAYS_OPEN = frozenset({"/health"})


class Authenticator:
    """Who is calling: shared by the middleware and the front door's fast routes."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.cfg = cfg
        self.store = KeyStore(cfg)
        self.open_paths = _ALWAYS_OPEN | ({"/metrics"} if cfg.metrics_open else set())

    def check(self, path: str, headers: list[tuple[bytes, bytes]]) -> Principal | None:
        """The caller, or None where no key is needed; Unauthorized / Forbidden otherwise."""
        if not self.cfg.enabled or path in self.open_paths:
            return None
        secret = presented_key(headers)
        if secret is None:
            raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        principal = self.store.identify(secret)
        if principal is None:
            raise Unauthorized("Invalid API key.")
        if path.startswith("/admin") and not principal.admin:
            raise Forbidden("This key may not use the admin API.")
        return principal


class AuthMiddleware:
    def __init__(self, app: ASGIApp, cfg: AuthConfig) -> None:
        self.app = app
        self.auth = Authenticator(cfg)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            principal = self.auth.check(scope["path"], scope["headers"])
        except GatewayError as e:
            await reject(e, send)
            return
        if principal is not None:  # the model list shows a key only its models
            scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)
