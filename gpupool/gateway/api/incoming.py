"""What a route handler needs from an HTTP request, straight from the ASGI scope.

The generate and pass-through routes run on every token-bearing request, so they never build a
Starlette ``Request`` (a headers object, a URL, a state wrapper): they read the raw header list
once and keep what the front door (``front.py``) learned about the caller in ``state``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from gpupool.gateway.errors import InvalidBody
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.upstream.client import DROP_REQUEST_HEADERS


@dataclass(slots=True)
class Incoming:
    request_id: str
    headers: list[tuple[bytes, bytes]]
    principal: Principal | None = None
    state: dict[str, Any] = field(default_factory=dict)

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower case), or None."""
        for k, v in self.headers:
            if k == name:
                return v.decode("latin-1")
        return None

    def number(self, name: bytes) -> float | None:
        """A numeric header; 400 when present and not a number."""
        value = self.header(name)
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            raise InvalidBody(f"Header `{name.decode()}` must be a number.") from None

    def tenant(self) -> str:
        """The key's tenant; without auth, a stable hash of the presented key (or anonymous)."""
        if self.principal is not None:
            return self.principal.tenant
        key = self.header(b"authorization") or self.header(b"x-api-key")
        return hashlib.sha256(key.encode()).hexdigest()[:16] if key else "anonymous"

    def forward_headers(self) -> dict[str, str]:
        """The client's headers a worker may see (hop-by-hop and gateway ones dropped)."""
        return {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in self.headers
            if k not in DROP_REQUEST_HEADERS
        }
