"""The front door: a pure ASGI app that serves the token-bearing routes itself.

Chat, completions and the pass-through POST routes carry every token, so they skip Starlette's
router, middleware stack and ``Request`` objects: one function here gives the request its id,
authenticates it, reads the bounded body, runs the route's handler and writes the
:class:`Reply`. Everything else (health, metrics, the model list, admin) goes on to Starlette,
whose middleware does the same id and auth work for those routes.

While a handler runs, one watcher task listens for the client's disconnect and cancels it: a
queued request leaves the queue, a worker connection is dropped (vLLM aborts the request), and
a stream stops, so nothing runs for a client that has gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

from starlette.applications import Starlette
from starlette.types import Message, Receive, Scope, Send

from gpupool.gateway.api.errors import reject
from gpupool.gateway.api.middleware import (
    current_request_id,
    new_request_id,
    read_body,
    request_id_of,
)
from gpupool.gateway.api.openai_routes import BODY_ROUTES, BodyHandler
from gpupool.gateway.api.protocol import CoalescingCycle
from gpupool.gateway.api.responses import write_reply
from gpupool.gateway.errors import GatewayError, RequestTimeout
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.security.middleware import Authenticator

if TYPE_CHECKING:
    from gpupool.config.models import GpupoolConfig
    from gpupool.gateway.services import Services

log = logging.getLogger("gpupool.api")


class MethodNotAllowed(GatewayError):
    status = 405
    type = "Error"


class Front:
    def __init__(self, app: Starlette, cfg: GpupoolConfig) -> None:
        self.app = app
        self.auth = Authenticator(cfg.auth)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = BODY_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope["headers"]) or new_request_id()
        token = current_request_id.set(rid.decode("latin-1"))
        try:
            await self._serve(handler, scope, receive, send, rid)
        finally:
            current_request_id.reset(token)

    async def _serve(
        self, handler: BodyHandler, scope: Scope, receive: Receive, send: Send, rid: bytes
    ) -> None:
        extra = [(b"x-request-id", rid)]
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        try:
            principal = self.auth.check(scope["path"], headers)
            if scope["method"] != "POST":
                raise MethodNotAllowed("Method Not Allowed")
            svc = cast("Services", self.app.state.services)
            raw = await _body(svc, headers, receive)
        except GatewayError as e:
            await reject(e, send, extra)
            return
        incoming = Incoming(rid.decode("latin-1"), headers, principal)
        task = asyncio.current_task()
        assert task is not None
        gone: list[bool] = []
        watcher = _watch_disconnect(send, receive, task, gone)
        try:
            try:
                reply = await handler(svc, incoming, raw)
            except GatewayError as e:
                await reject(e, send, extra)
                return
            except Exception:
                log.exception("unexpected error on %s %s", scope["method"], scope["path"])
                await reject(GatewayError("Internal server error."), send, extra)
                return
            try:
                await write_reply(reply, send, extra)
            finally:
                watcher.cancel()
                if reply.after is not None:
                    await _after(reply.after)
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left; it is not our task that is being cancelled
        finally:
            watcher.cancel()


async def _after(after: Callable[[], Awaitable[None]]) -> None:
    """A reply's book-keeping, once written (or not: the client left); never skipped."""
    try:
        await after()
    except Exception:
        log.exception("request book-keeping failed")


async def _body(svc: Services, headers: list[tuple[bytes, bytes]], receive: Receive) -> bytes:
    """The whole body, within the configured size (413) and time (408).

    The deadline is one timer that cancels this task (``asyncio.timeout`` does the same with
    a context manager's worth of extra work, on every request).
    """
    declared = None
    for k, v in headers:
        if k == b"content-length":
            declared = int(v) if v.isdigit() else None
            break
    server = svc.cfg.server
    task = asyncio.current_task()
    assert task is not None
    expired: list[bool] = []
    timer = asyncio.get_running_loop().call_later(server.body_timeout_s, _expire, task, expired)
    try:
        return await read_body(receive, server.max_body_bytes, declared)
    except asyncio.CancelledError:
        if not expired:
            raise
        task.uncancel()
        raise RequestTimeout("The request body did not arrive in time.") from None
    finally:
        timer.cancel()


def _expire(task: asyncio.Task[None], expired: list[bool]) -> None:
    expired.append(True)
    task.cancel()


class _Watch:
    """Stops watching for the client's disconnect: ``cancel()``, whichever way it watches."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: CoalescingCycle) -> None:
        self.cycle = cycle

    def cancel(self) -> None:
        self.cycle.on_disconnect(None)


def _watch_disconnect(
    send: Send, receive: Receive, task: asyncio.Task[None], gone: list[bool]
) -> _Watch | asyncio.Future[None]:
    """Cancel ``task`` when the client disconnects.

    Under gpupool's own HTTP protocol the request cycle calls back when the connection drops
    (no extra task); under any other ASGI server a task waits on ``receive()``.
    """
    cycle = getattr(send, "__self__", None)
    if isinstance(cycle, CoalescingCycle):

        def left() -> None:
            gone.append(True)
            task.cancel()

        cycle.flow.resume_reading()  # a large body may have paused it: a close must be seen
        cycle.on_disconnect(left)
        return _Watch(cycle)
    return asyncio.ensure_future(_watch(receive, task, gone))


async def _watch(receive: Receive, task: asyncio.Task[None], gone: list[bool]) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
            task.cancel()
            return
