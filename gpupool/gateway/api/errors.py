"""The one place errors become HTTP responses: vLLM's envelope, never a traceback."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gpupool.gateway.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    PayloadTooLarge,
)

log = logging.getLogger("gpupool.api")

_BY_STATUS: dict[int, type[GatewayError]] = {400: BadRequest, 404: NotFound, 413: PayloadTooLarge}


def render(e: GatewayError) -> Response:
    return Response(
        e.to_json(), status_code=e.status, media_type="application/json", headers=e.headers
    )


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
