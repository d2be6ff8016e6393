"""The token-bearing routes served straight from the HTTP protocol, without ASGI in between.

Under ``gpupool serve`` (uvicorn's httptools protocol, ``protocol.py``), a ``POST`` to one of
the pipeline's routes (``pipeline/kinds.py``) is not turned into an ASGI scope, a request
cycle, ``receive``/``send`` messages and a task started before its body: the protocol collects
the head and the body into a :class:`Lane` and starts one task when the body is complete. The
task runs the same front door code as the ASGI path (``front.py``): auth, the pipeline, the
error envelope, the reply's ``after``. The lane writes the reply itself: a whole body as one
buffer, a stream chunk by chunk with chunked framing, paused while the client's socket is (a
client that takes less than ``server.write_min_bytes`` per ``server.write_timeout_s`` is cut by
the protocol, ``stall.py``, and the lane hears it as a disconnect).

The limits stay where they were, enforced here instead of in the body reader: a declared or
received body over ``server.max_body_bytes`` is a 413, a body still arriving after
``server.body_timeout_s`` a 408; both close the connection (the rest of the body is not read).
A head the front door refuses (no key, wrong method) is answered once the body is in, or at
once, with the connection closed, if the body is still arriving.

Anything else (other routes, ``Expect`` handling aside, an access log, a root path, a query
string, a percent-encoded path, HTTP/1.0) takes uvicorn's own way through ASGI, unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gpupool.gateway.api.errors import error_reply
from gpupool.gateway.errors import GatewayError
from gpupool.gateway.reply import Reply

if TYPE_CHECKING:
    from gpupool.gateway.pipeline.kinds import Kind
    from gpupool.gateway.security.keys import Principal

log = logging.getLogger("gpupool.api")

_CHUNK_END = b"0\r\n\r\n"


class HeaderSplit(Exception):
    """A reply header with a line break in it: never written (response splitting)."""


class Lane:
    """One request on the lane: its head and body in, its reply out.

    Stands where uvicorn's protocol expects its request cycle (``protocol.cycle``): it has the
    attributes the protocol reads and sets (``response_complete``, ``disconnected``,
    ``keep_alive``, ``message_event``).
    """

    __slots__ = (
        "_gone",
        "_on_gone",
        "body",
        "closing",
        "complete",
        "default_headers",
        "error",
        "expect_continue",
        "flow",
        "headers",
        "keep_alive",
        "kind",
        "on_response",
        "path",
        "principal",
        "ready",
        "response_complete",
        "response_started",
        "size",
        "stalled",
        "task",
        "transport",
    )

    def __init__(
        self,
        transport: asyncio.Transport,
        flow: FlowControl,
        path: str,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        default_headers: list[tuple[bytes, bytes]],
        on_response: Callable[[], None],
    ) -> None:
        self.transport = transport
        self.flow = flow
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.default_headers = default_headers
        self.on_response = on_response
        self.kind: Kind | None = None
        self.principal: Principal | None = None
        self.error: GatewayError | None = None  # the head was refused: answer this
        self.closing = False  # the body is not read: answer ``error`` and close
        self.expect_continue = False  # the client waits for ``100 Continue`` before its body
        self.body: list[bytes] = []
        self.size = 0
        self.complete = False  # the whole body is in
        self.ready = False  # the connection's earlier responses are written
        self.task: asyncio.Task[None] | None = None
        self.response_started = False
        self.response_complete = False
        self.stalled = 0.0  # > 0: cut after its client took no bytes for this many seconds
        self._gone = False
        self._on_gone: Callable[[], None] | None = None

    # ---- what uvicorn's protocol touches ----------------------------------------------------

    @property
    def disconnected(self) -> bool:
        return self._gone

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        self._gone = value
        callback = self._on_gone
        if value and callback is not None:
            self._on_gone = None
            callback()

    @property
    def message_event(self) -> _Unwaited:
        return _UNWAITED  # ``connection_lost`` sets it; nothing on the lane waits on it

    # ---- the front door's side ---------------------------------------------------------------

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once if the client disconnects (at once if it has)."""
        if self._gone:
            callback()
            return
        self._on_gone = callback
        self.flow.resume_reading()  # a paused socket would not see the close

    def unwatch(self) -> None:
        self._on_gone = None

    def stall(self, seconds: float) -> bool:
        """Its client took no bytes for ``seconds`` (``stall.py``): it is being cut. Whether
        the front door watches it (and logs the cut, with the request's id)."""
        self.stalled = seconds
        return self._on_gone is not None

    def client_gone(self) -> bool:
        """Whether the client has closed its end, including a close the event loop has not
        read yet (a peek at the socket: its EOF is there before ``connection_lost`` runs). A
        slot freed by one leaving client is granted to the next waiter before the loop reads
        the next close; asked then, this keeps a request whose client left from being sent."""
        if self._gone or self.transport.is_closing():
            return True
        fd = _fileno(self.transport)
        if fd is None:
            return False
        if fd < 0:
            return True
        sock = socket.socket(fileno=fd)  # the same descriptor: detached below, never closed
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        finally:
            sock.detach()

    def raw_body(self) -> bytes:
        body = self.body
        return body[0] if len(body) == 1 else b"".join(body)

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        serve: Coroutine[Any, Any, None],
        tasks: set[asyncio.Task[None]],
    ) -> None:
        """Serve it (the body is in, the connection's earlier responses are out)."""
        task = self.task = loop.create_task(serve)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def failed(self, exc: BaseException) -> None:
        """As uvicorn's ``run_asgi``: a 500 if nothing went out yet, else the connection cut."""
        if not isinstance(exc, asyncio.CancelledError):
            log.error("unexpected error on the request lane", exc_info=exc)
        if not self.response_started and not self._gone:
            self.write_now(_internal_error(), [], close=True)
        else:
            self.transport.close()

    def finished(self) -> None:
        """The serving task ended: a reply left unfinished cuts the connection."""
        if not self.response_complete and not self._gone:
            self.transport.close()

    # ---- writing -----------------------------------------------------------------------------

    def write_now(self, reply: Reply, extra: list[tuple[bytes, bytes]], close: bool) -> None:
        """A whole reply in one write (``close``: then close the connection)."""
        if close:
            self.keep_alive = False
        self._whole(reply, extra)

    async def write(self, reply: Reply, extra: list[tuple[bytes, bytes]]) -> None:
        """``reply`` with ``extra`` headers: a sized body, or a stream until it ends."""
        if reply.stream is None:
            self._whole(reply, extra)
            return
        stream = reply.stream
        try:
            if self._gone:
                return
            head = self._head(reply, extra, b"transfer-encoding: chunked\r\n")
            self.response_started = True
            self.transport.write(head)
            flow = self.flow
            async for chunk in stream:
                if flow.write_paused and not self._gone:
                    await flow.drain()
                if self._gone:
                    return
                if chunk:
                    self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            if not self._gone:
                self.transport.write(_CHUNK_END)
                self._done()
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _whole(self, reply: Reply, extra: list[tuple[bytes, bytes]]) -> None:
        if self._gone or self.response_started:
            return
        body = reply.body
        head = self._head(reply, extra, b"content-length: %d\r\n" % len(body))
        self.response_started = True
        if len(body) < 65536:  # one write; a large body is not copied to join it
            self.transport.write(head + body)
        else:
            self.transport.write(head)
            self.transport.write(body)
        self._done()

    def _done(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _head(self, reply: Reply, extra: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
        """Status line and headers, the framing header given, ``connection: close`` if closing."""
        parts = [STATUS_LINE[reply.status]]
        for k, v in self.default_headers:
            parts.append(b"%b: %b\r\n" % (k, v))
        for name, value in reply.headers:
            parts.append(b"%b: %b\r\n" % (name.lower().encode("latin-1"), value.encode("latin-1")))
        for k, v in extra:
            parts.append(b"%b: %b\r\n" % (k, v))
        parts.append(framing)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        lines = len(parts)  # every part is one line; none may hold another line break
        if head.count(b"\n") != lines or head.count(b"\r") != lines:
            raise HeaderSplit("a reply header contains a line break")
        return head


def _fileno(transport: asyncio.Transport) -> int | None:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
        return None
    fd: int = sock.fileno()
    return fd


class _Unwaited:
    def set(self) -> None:
        pass


_UNWAITED = _Unwaited()


def _internal_error() -> Reply:
    return error_reply(GatewayError("Internal server error."))
