"""A thin endpoint wrapper for the Starlette routes: handler(request) -> ASGI response."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

Handler = Callable[[Request], Awaitable[ASGIApp]]


class Endpoint:
    """Starlette calls classes as plain ASGI apps: no extra wrapping per request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive))
        await response(scope, receive, send)


def services(request: Request) -> Services:
    return cast("Services", request.app.state.services)
