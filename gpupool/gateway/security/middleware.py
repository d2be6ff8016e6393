"""Authentication as pure ASGI middleware: 401 without a valid key, 403 for the wrong kind.

``/health`` is always open, ``/metrics`` when the config says so; ``/admin/*`` needs the admin
key; every other route needs a client key (or the admin key). The caller's identity goes into
``scope["state"]`` (tenant, priority range, allowed models) for the handlers.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gpupool.config.models import AuthConfig
from gpupool.gateway.errors import Forbidden, GatewayError, Unauthorized
from gpupool.gateway.security.keys import KeyStore, Principal, presented_key

_ALWAYS_OPEN = frozenset({"/health"})


class AuthMiddleware:
    def __init__(self, app: ASGIApp, cfg: AuthConfig) -> None:
        self.app = app
        self.cfg = cfg
        self.store = KeyStore(cfg)
        self.open_paths = _ALWAYS_OPEN | ({"/metrics"} if cfg.metrics_open else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.cfg.enabled or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            principal = self._authorize(scope)
        except GatewayError as e:
            await _reject(e, send)
            return
        state = scope.setdefault("state", {})
        state["principal"] = principal
        state["tenant"] = principal.tenant
        if principal.key is not None:
            state["priority_range"] = (principal.key.priority_min, principal.key.priority_max)
        await self.app(scope, receive, send)

    def _authorize(self, scope: Scope) -> Principal:
        secret = presented_key(scope["headers"])
        if secret is None:
            raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        principal = self.store.identify(secret)
        if principal is None:
            raise Unauthorized("Invalid API key.")
        if scope["path"].startswith("/admin") and not principal.admin:
            raise Forbidden("This key may not use the admin API.")
        return principal


async def _reject(e: GatewayError, send: Send) -> None:
    body = e.to_json()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if isinstance(e, Unauthorized):
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
