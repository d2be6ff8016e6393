"""A thin endpoint wrapper: handler(request) -> ASGI response, with the services at hand."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gpupool.gateway.api.middleware import read_body
from gpupool.gateway.errors import RequestTimeout

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

Handler = Callable[[Request], Awaitable[ASGIApp]]


class Endpoint:
    """Starlette calls classes as plain ASGI apps: no extra wrapping on the hot path."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive))
        await response(scope, receive, send)


def services(request: Request) -> Services:
    return cast("Services", request.app.state.services)


async def body(request: Request) -> bytes:
    svc = services(request)
    declared = request.headers.get("content-length")
    size = int(declared) if declared and declared.isdigit() else None
    server = svc.cfg.server
    try:
        async with asyncio.timeout(server.body_timeout_s):
            return await read_body(request.receive, server.max_body_bytes, size)
    except TimeoutError:
        raise RequestTimeout("The request body did not arrive in time.") from None


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))
