"""What the proxy hands back to the HTTP layer: a whole body, or a stream of bytes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson

JSON = "application/json"
SSE = "text/event-stream"


@dataclass(slots=True)
class Reply:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    after: Callable[[], Awaitable[None]] | None = None
    """Book-keeping the HTTP layer runs once a whole body has been written (never skipped):
    the client gets its answer before the gateway counts tokens and returns the slot."""

    @classmethod
    def json(cls, status: int, obj: object, headers: list[tuple[str, str]] | None = None) -> Reply:
        return cls(status, [("content-type", JSON), *(headers or [])], orjson.dumps(obj))
