"""The front door: serves the token-bearing routes itself, two ways in, one way through.

Chat, completions and the pass-through POST routes carry every token, so they skip Starlette's
router, middleware stack and ``Request`` objects. Under ``gpupool serve`` they do not even go
through ASGI: the HTTP protocol hands them over as a :class:`~gpupool.gateway.api.lane.Lane`
(``head`` when the head is in, ``serve_lane`` once the body is). Under any other ASGI server
(and in tests without sockets) this is a pure ASGI app that does the same. Either way one
function (``_respond``) runs the route's handler and writes the :class:`Reply`. Everything else
(health, metrics, the model list, admin) goes on to Starlette, whose middleware does the same
id and auth work for those routes.

While a handler runs, a client that disconnects cancels it (a callback from the connection,
or a task waiting on ``receive()`` under other servers): a queued request leaves the queue, a
worker connection is dropped (vLLM aborts the request), and a stream stops, so nothing runs
for a client that has gone. A client that stays but takes less than ``server.write_min_bytes``
of its reply per ``server.write_timeout_s`` is cut by the protocol (``stall.py``) and leaves
the same way; the line logged here names the request (and is counted with the ``cancelled``
requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from starlette.applications import Starlette
from starlette.types import Message, Receive, Scope, Send

from gpupool.gateway.api.errors import error_reply, reject
from gpupool.gateway.api.lane import Lane
from gpupool.gateway.api.middleware import (
    content_length,
    new_request_id,
    read_body,
    request_id_of,
    request_ids,
    reset_log_ids,
    set_log_ids,
)
from gpupool.gateway.api.protocol import CoalescingCycle
from gpupool.gateway.api.responses import write_reply
from gpupool.gateway.errors import GatewayError, RequestTimeout
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.pipeline.kinds import KINDS, STORED, Kind, stored_target
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.middleware import Authenticator

if TYPE_CHECKING:
    from gpupool.config.models import GpupoolConfig, ServerConfig
    from gpupool.gateway.services import Services

log = logging.getLogger("gpupool.api")
prompts_log = logging.getLogger("gpupool.requests")


class MethodNotAllowed(GatewayError):
    status = 405
    type = "Error"


class Front:
    def __init__(self, app: Starlette, cfg: GpupoolConfig) -> None:
        self.app = app
        self.auth = Authenticator(cfg.auth)
        self.server = cfg.server
        self.log_prompts = cfg.server.log_prompts
        self.services: Services | None = None  # set by the app's lifespan, before any request

    def configure(self, cfg: GpupoolConfig) -> None:
        """Take the settings a config reload changes here (``reload.LIVE``): the body's size
        and time limits (read by the lane too) and the prompt log."""
        self.server = cfg.server
        self.log_prompts = cfg.server.log_prompts

    # ---- through ASGI (any server; under `gpupool serve`, what the lane does not take) ----

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        kind = KINDS.get(path)
        target = stored_target(path) if kind is None else None
        if kind is None and target is None:
            await self.app(scope, receive, send)
            return
        if target is not None:  # a stored response's route: by method and what follows the id
            kind = STORED.get((scope["method"], target[1]), STORED[("GET", "")])
        assert kind is not None
        ours, theirs = request_ids(scope["headers"])
        tokens = set_log_ids(ours, theirs)
        try:
            await self._serve(kind, scope, receive, send, (ours, theirs))
        finally:
            reset_log_ids(tokens)

    async def _serve(
        self, kind: Kind, scope: Scope, receive: Receive, send: Send, ids: tuple[bytes, bytes]
    ) -> None:
        ours, theirs = ids
        extra = [(b"x-request-id", theirs or ours)]
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        try:
            principal = self.auth.check(scope["method"], scope["path"], headers)
            if scope["method"] != kind.method:
                raise MethodNotAllowed("Method Not Allowed")
            raw = await _body(self.server, headers, receive)
        except GatewayError as e:
            await reject(e, send, extra, kind)
            return
        incoming = Incoming(ours.decode("latin-1"), headers, principal,
                            theirs.decode("latin-1"))  # fmt: skip
        if kind.stored:
            incoming.path, incoming.query = scope["path"], scope.get("query_string", b"")
        task = asyncio.current_task()
        assert task is not None
        await self._respond(kind, incoming, raw, _AsgiOut(send, receive), task, extra)

    # ---- the lane (``lane.py``): served straight from the HTTP protocol --------------------

    def head(self, lane: Lane, method: bytes) -> bool:
        """Whether ``lane.path`` is a route the lane serves; if so, its kind and caller (or the
        error its head earns) are set on ``lane``."""
        kind = KINDS.get(lane.path)
        if kind is None:
            return False
        lane.kind = kind
        try:
            lane.principal = self.auth.check(method.decode("latin-1"), lane.path, lane.headers)
            if method != b"POST":
                raise MethodNotAllowed("Method Not Allowed")
        except GatewayError as e:
            lane.error = e
        return True

    def refuse(self, lane: Lane) -> None:
        """Answer ``lane.error`` now and close the connection (its body is not read)."""
        assert lane.error is not None
        rid = request_id_of(lane.headers) or new_request_id()
        lane.write_now(error_reply(lane.error, lane.kind), [(b"x-request-id", rid)], close=True)

    async def serve_lane(self, lane: Lane) -> None:
        """The lane's task: the request from its head and body to its reply's ``after``."""
        try:
            ours, theirs = request_ids(lane.headers)
            set_log_ids(ours, theirs)  # the lane's own task: no reset
            extra = [(b"x-request-id", theirs or ours)]
            if lane.error is not None:
                lane.write_now(error_reply(lane.error, lane.kind), extra, close=False)
                return
            assert lane.kind is not None and lane.task is not None
            incoming = Incoming(ours.decode("latin-1"), lane.headers, lane.principal,
                                theirs.decode("latin-1"))  # fmt: skip
            incoming.gone = lane.client_gone
            await self._respond(lane.kind, incoming, lane.raw_body(), lane, lane.task, extra)
        except BaseException as exc:
            lane.failed(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            lane.finished()

    # ---- both ------------------------------------------------------------------------------

    async def _respond(
        self,
        kind: Kind,
        incoming: Incoming,
        raw: bytes,
        out: Out,
        task: asyncio.Task[None],
        extra: list[tuple[bytes, bytes]],
    ) -> None:
        """Run the pipeline and write its reply (with ``extra`` headers: the request id); the
        reply's ``after`` always runs.

        While the handler runs and the reply is written, a client that disconnects cancels
        ``task``: a queued request leaves the queue, a worker connection is dropped.
        """
        svc = self.services or self._services()
        gone: list[bool] = []

        def left() -> None:
            gone.append(True)
            task.cancel()

        out.watch(left)
        try:
            if self.log_prompts:
                prompts_log.info("%s body: %s", kind.path, raw[:8192].decode("utf-8", "replace"))
            try:
                reply = await svc.pipeline.handle(kind, incoming, raw)
            except GatewayError as e:
                await out.write(error_reply(e, kind), extra)
                return
            except Exception:
                log.exception("unexpected error on POST %s", kind.path)
                await out.write(error_reply(GatewayError("Internal server error.")), extra)
                return
            try:
                if reply.stream is None and isinstance(out, Lane):
                    out.write_now(reply, extra, close=False)  # no coroutine for a whole body
                else:
                    await out.write(reply, extra)
            finally:
                out.unwatch()
                if reply.after is not None:  # the reply's book-keeping: never skipped
                    try:
                        await reply.after()
                    except Exception:
                        log.exception("request book-keeping failed")
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left; it is not our task that is being cancelled
            _log_stall(out, incoming)
        finally:
            out.unwatch()

    def _services(self) -> Services:
        """Services set on the app by hand (tests without a lifespan)."""
        svc: Services = self.app.state.services
        self.services = svc
        return svc


def _log_stall(out: Out, incoming: Incoming) -> None:
    """The line for a client cut for taking too little of its reply (``stall.py``), if it was."""
    if out.stalled:
        log.warning(
            "request %s cut: its client took too little of the reply in %g s "
            "(server.write_min_bytes per server.write_timeout_s); its worker request closed, "
            "its slots given back",
            incoming.request_id, out.stalled,
        )  # fmt: skip


class Out(Protocol):
    """Where the front door writes a reply, and hears of the client leaving."""

    async def write(self, reply: Reply, extra: list[tuple[bytes, bytes]]) -> None: ...

    def watch(self, callback: Callable[[], None]) -> None: ...

    def unwatch(self) -> None: ...

    @property
    def stalled(self) -> float:
        """> 0: the client was cut after taking no bytes for this many seconds."""
        ...


class _AsgiOut:
    """:class:`Out` through ASGI's ``send``; the disconnect heard from gpupool's own request
    cycle (a callback, no task) or, under any other server, by a task waiting on ``receive``."""

    __slots__ = ("_stop", "receive", "send")

    def __init__(self, send: Send, receive: Receive) -> None:
        self.send = send
        self.receive = receive
        self._stop: Callable[[], object] | None = None

    async def write(self, reply: Reply, extra: list[tuple[bytes, bytes]]) -> None:
        await write_reply(reply, self.send, extra)

    def watch(self, callback: Callable[[], None]) -> None:
        cycle = getattr(self.send, "__self__", None)
        if isinstance(cycle, CoalescingCycle):
            cycle.flow.resume_reading()  # a large body may have paused it: a close must be seen
            cycle.on_disconnect(callback)
            self._stop = lambda: cycle.on_disconnect(None)
        else:
            self._stop = asyncio.ensure_future(_watch(self.receive, callback)).cancel

    def unwatch(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    @property
    def stalled(self) -> float:
        cycle = getattr(self.send, "__self__", None)
        return cycle.stalled if isinstance(cycle, CoalescingCycle) else 0.0


async def _body(
    server: ServerConfig, headers: list[tuple[bytes, bytes]], receive: Receive
) -> bytes:
    """The whole body, within the configured size (413) and time (408).

    The deadline is one timer that cancels this task (``asyncio.timeout`` does the same with
    a context manager's worth of extra work, on every request).
    """
    declared = content_length(headers)
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


async def _watch(receive: Receive, callback: Callable[[], None]) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            callback()
            return
