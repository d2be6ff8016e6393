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
    """Starlette calls classes as plain ASGI apps: no extra wrapping on the hot path.

    Once a handler has read the body, a watcher cancels it if the client disconnects while it
    waits (in the queue, or for a worker): the queued request is dropped and the worker's
    connection closed, so nothing runs for a client that has gone.
    """

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await self.handler(request)
        except asyncio.CancelledError:
            if not _client_gone(request):
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return
        finally:
            _stop_watch(request)
        await response(scope, receive, send)


_WATCH = "disconnect_watch"
_GONE = "client_gone"


async def _watch(request: Request, task: asyncio.Task[object]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            request.scope["state"][_GONE] = True
            task.cancel()
            return


def _start_watch(request: Request) -> None:
    task = asyncio.current_task()
    if task is not None:
        request.scope.setdefault("state", {})[_WATCH] = asyncio.ensure_future(_watch(request, task))


def _stop_watch(request: Request) -> None:
    watcher = request.scope.get("state", {}).pop(_WATCH, None)
    if watcher is not None:
        watcher.cancel()


def _client_gone(request: Request) -> bool:
    return bool(request.scope.get("state", {}).get(_GONE))


def services(request: Request) -> Services:
    return cast("Services", request.app.state.services)


async def body(request: Request) -> bytes:
    svc = services(request)
    declared = request.headers.get("content-length")
    size = int(declared) if declared and declared.isdigit() else None
    server = svc.cfg.server
    try:
        async with asyncio.timeout(server.body_timeout_s):
            raw = await read_body(request.receive, server.max_body_bytes, size)
    except TimeoutError:
        raise RequestTimeout("The request body did not arrive in time.") from None
    _start_watch(request)
    return raw


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))
