"""The one place errors become HTTP replies: vLLM's envelope, never a traceback.

:func:`error_reply` turns any :class:`GatewayError` into a :class:`Reply` (status, the
envelope, ``Retry-After`` for 429s, ``WWW-Authenticate`` for 401s). The front door writes it
with :func:`reject`; Starlette's exception handlers return it; a stream that has begun carries
the same envelope as an event (``GatewayError.sse_event``, ``pipeline/relay.stream_error``).
"""

from __future__ import annotations

import logging

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Send

from gpupool.gateway.api.responses import write_reply
from gpupool.gateway.errors import (
    BadRequest,
    GatewayError,
    InvalidBody,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
)
from gpupool.gateway.pipeline.kinds import Errors, Kind
from gpupool.gateway.reply import JSON, Reply

log = logging.getLogger("gpupool.api")

_BY_STATUS: dict[int, type[GatewayError]] = {400: BadRequest, 404: NotFound, 413: PayloadTooLarge}


def error_reply(e: GatewayError, kind: Kind | None = None) -> Reply:
    """``e`` as the reply of route ``kind`` (vLLM's envelope; the Anthropic routes' own shape
    for what vLLM's Anthropic handler would refuse, its validator's 400s staying OpenAI's)."""
    if e.status >= 500:  # the gateway's or a worker's failure, with its request id (the
        # pool page's recent errors, ui/feed.py, keep these); a client's own mistakes are not
        log.warning("answered %d %s: %s", e.status, e.type, e.message)
    headers = [("content-type", JSON), *((k.lower(), v) for k, v in e.headers.items())]
    if isinstance(e, Unauthorized):
        headers.append(("www-authenticate", "Bearer"))
    if kind is not None and kind.errors is Errors.anthropic and not isinstance(e, InvalidBody):
        error = {"type": e.type, "message": e.message}
        return Reply(e.status, headers, orjson.dumps({"type": "error", "error": error}))
    return Reply(e.status, headers, e.to_json())


async def reject(
    e: GatewayError,
    send: Send,
    extra: list[tuple[bytes, bytes]] | None = None,
    kind: Kind | None = None,
) -> None:
    """Send ``e`` as a whole response straight through ASGI (no framework below us)."""
    await write_reply(error_reply(e, kind), send, extra or [])


def render(e: GatewayError) -> Response:
    """:func:`error_reply` as Starlette's exception handlers must return it."""
    reply = error_reply(e)
    return Response(reply.body, reply.status, headers=dict(reply.headers))


async def gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return render(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    cls = _BY_STATUS.get(exc.status_code)
    if cls is None:
        err = GatewayError(str(exc.detail))
        err.status = exc.status_code
        err.type = "Error"
        return render(err)
    return render(cls(str(exc.detail)))


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return render(GatewayError("Internal server error."))
