"""Pure ASGI middleware: request ids and body size limits. No BaseHTTPMiddleware."""

from __future__ import annotations

import contextvars
import itertools
import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpupool.gateway.errors import PayloadTooLarge

# The request being served, for log lines (see gpupool/cli/logs.py).
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
# ... and the client's own x-request-id beside it, when it sent one (never sent to a worker).
client_request_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "client_request_id", default=""
)


def request_id_of(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The client's ``x-request-id`` (at most 128 bytes), or ``b""``."""
    for k, v in headers:
        if k == b"x-request-id":
            return v[:128]
    return b""


# Ids: a random prefix per process and a counter (no `getrandom()` per request). Unique, and
# 32 hex digits as before; an id is no secret.
_ID_PREFIX = os.urandom(8).hex().encode()
_ids = itertools.count(1)


def new_request_id() -> bytes:
    return b"%b%016x" % (_ID_PREFIX, next(_ids) & 0xFFFFFFFFFFFFFFFF)


def request_ids(headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """(the gateway's own id, unique, the one a worker sees; the client's ``x-request-id``, or
    ``b""``). The reply echoes the client's, else ours; logs carry both
    (:func:`set_log_ids`)."""
    return new_request_id(), request_id_of(headers)


LogIds = tuple[contextvars.Token[str], contextvars.Token[str]]


def set_log_ids(ours: bytes, theirs: bytes) -> LogIds:
    return (current_request_id.set(ours.decode("latin-1")),
            client_request_id.set(theirs.decode("latin-1")))  # fmt: skip


def reset_log_ids(tokens: LogIds) -> None:
    current_request_id.reset(tokens[0])
    client_request_id.reset(tokens[1])


class RequestIdMiddleware:
    """Every request has an ``x-request-id`` (the client's, or a new one), echoed back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope["headers"]) or new_request_id()
        token = current_request_id.set(rid.decode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The declared ``content-length`` (a valid one), or None."""
    for k, v in headers:
        if k == b"content-length":
            return int(v) if v.isdigit() else None
    return None


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body larger than {limit} bytes.")


async def read_body(receive: Receive, limit: int, declared: int | None) -> bytes:
    """The whole request body, refusing more than ``limit`` bytes (413)."""
    if declared is not None and declared > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)
