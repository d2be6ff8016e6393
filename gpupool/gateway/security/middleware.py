"""Authentication as pure ASGI middleware: 401 without a valid key, 403 for the wrong kind; before
the key, what a page on another site may not send (``browser.py``: 415 / 403).

``/health`` and the pool page's static files (``/ui``: no data; the page asks for the admin
key and sends it with ``fetch()``, see ``gateway/api/ui_routes.py``) are always open, ``/metrics``
when the config says so; ``/admin/*`` needs the admin
key; every other route needs a client key (or the admin key). The token-bearing routes are
checked by the front door (``gateway/api/front.py``) with the same :class:`Authenticator`, which
also hands the caller's identity to their handlers.

One :class:`Authenticator` serves the whole gateway (the services own it). What it checks
against (the auth settings and their :class:`KeyStore`) is one immutable snapshot, replaced
whole by :meth:`Authenticator.swap` on a config reload: a request sees the old keys or the new
ones, never a mix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from starlette.types import ASGIApp, Receive, Scope, Send

from gpupool.config.models import ApiKey, AuthConfig
from gpupool.gateway.api.errors import reject
from gpupool.gateway.api.ui_routes import PAGE_PATHS
from gpupool.gateway.errors import Forbidden, GatewayError, Unauthorized
from gpupool.gateway.security.browser import BrowserGuard
from gpupool.gateway.security.keys import KeyStore, Principal, presented_key

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

_ALWAYS_OPEN = frozenset({"/health"}) | PAGE_PATHS


@dataclass(frozen=True, slots=True)
class AuthState:
    """What one configuration's ``auth`` section says, keys loaded: checked per request."""

    cfg: AuthConfig
    store: KeyStore
    open_paths: frozenset[str]
    guard: BrowserGuard

    @classmethod
    def build(cls, cfg: AuthConfig, store: KeyStore | None = None) -> AuthState:
        """Reads the keys file unless ``store`` is given (``KeysFileError`` when invalid)."""
        opened = _ALWAYS_OPEN | ({"/metrics"} if cfg.metrics_open else set())
        guard = BrowserGuard.of(not cfg.enabled, cfg.allowed_hosts, PAGE_PATHS)
        return cls(cfg, store or KeyStore(cfg), frozenset(opened), guard)


class Authenticator:
    """Who is calling: shared by the middleware and the front door's fast routes."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.state = AuthState.build(cfg)

    @property
    def cfg(self) -> AuthConfig:
        return self.state.cfg

    @property
    def store(self) -> KeyStore:
        return self.state.store

    def swap(self, state: AuthState) -> None:
        """Check every later request against ``state`` (built beforehand: nothing can fail)."""
        self.state = state

    def knows(self, key: ApiKey) -> bool:
        """Whether ``key`` is still valid (a reload may have removed it since it was checked)."""
        state = self.state
        return not state.cfg.enabled or state.store.knows(key)

    def check(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> Principal | None:
        """The caller, or None where no key is needed; Unauthorized / Forbidden otherwise, and
        first what a page on another site may not send (``browser.py``)."""
        state = self.state
        state.guard.check(method, path, headers)
        if not state.cfg.enabled or path in state.open_paths:
            return None
        secret = presented_key(headers)
        if secret is None:
            raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        principal = state.store.identify(secret)
        if principal is None:
            raise Unauthorized("Invalid API key.")
        if path.startswith("/admin") and not principal.admin:
            raise Forbidden("This key may not use the admin API.")
        return principal


class AuthMiddleware:
    """Auth for the routes Starlette serves, with the services' :class:`Authenticator` (the
    one a reload swaps); ``cfg`` builds one of its own only where no services are set."""

    def __init__(self, app: ASGIApp, cfg: AuthConfig) -> None:
        self.app = app
        self.cfg = cfg
        self.own: Authenticator | None = None

    def _auth(self, scope: Scope) -> Authenticator:
        app = scope.get("app")
        svc = getattr(app.state, "services", None) if app is not None else None
        if svc is not None:
            return cast("Services", svc).auth
        if self.own is None:
            self.own = Authenticator(self.cfg)
        return self.own

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            principal = self._auth(scope).check(scope["method"], scope["path"], scope["headers"])
        except GatewayError as e:
            await reject(e, send)
            return
        if principal is not None:  # the model list shows a key only its models
            scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)
