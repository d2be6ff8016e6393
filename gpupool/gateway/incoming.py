"""What a route handler needs from an HTTP request, straight from the ASGI scope.

The generate and pass-through routes run on every token-bearing request, so they never build a
Starlette ``Request`` (a headers object, a URL, a state wrapper): they read the raw header list
once and keep who the caller is (``principal``), as the front door (``front.py``) found it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from gpupool.gateway.security.keys import Principal


@functools.lru_cache(maxsize=1024)
def _hashed(key: str) -> str:
    """A presented key's tenant name without auth: its SHA-256, cached (a client sends the
    same key on every request)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(slots=True)
class Incoming:
    request_id: str  # the gateway's own, unique: the id its worker sees
    headers: list[tuple[bytes, bytes]]
    principal: Principal | None = None
    client_request_id: str = ""  # the client's x-request-id: the reply's and the logs'
    path: str = ""  # a stored response's route: its path (``/v1/responses/{id}…``) and query
    query: bytes = b""
    gone: Callable[[], bool] | None = None  # whether the client has left (its close unread too)

    def left(self) -> bool:
        """Whether the client is known to have closed its connection, even if the gateway has
        not handled the close yet (a queued request is never sent for a client that left)."""
        return self.gone is not None and self.gone()

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower case), or None."""
        for k, v in self.headers:
            if k == name:
                return v.decode("latin-1")
        return None

    def priority_range(self) -> tuple[int, int] | None:
        """The priorities the caller's key may ask for, or None without a key."""
        key = self.principal.key if self.principal is not None else None
        return (key.priority_min, key.priority_max) if key is not None else None

    def allowed_models(self) -> frozenset[str] | None:
        """The model names (or aliases) the caller's key may use, or None for all."""
        key = self.principal.key if self.principal is not None else None
        return frozenset(key.models) if key is not None and key.models is not None else None

    def tenant(self) -> str:
        """The key's tenant; without auth, a stable hash of the presented key (or anonymous)."""
        if self.principal is not None:
            return self.principal.tenant
        key = self.header(b"authorization") or self.header(b"x-api-key")
        return _hashed(key) if key else "anonymous"
