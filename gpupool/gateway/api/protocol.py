"""uvicorn's httptools protocol with the limits a public server needs.

- The request head (request line and headers) must arrive within ``head_timeout_s`` of the
  connection opening or of its first bytes, or the connection is closed (slowloris). The timer
  is only armed when a head does not arrive in one read, so the usual request costs none.
- The request head may not exceed ``max_head_bytes``; beyond it: 431 and close.
- An idle keep-alive connection is closed after uvicorn's ``timeout_keep_alive``, by one timer
  per connection rather than one armed and cancelled per request.
- A client that takes fewer than ``write_min_bytes`` of a reply in ``write_timeout_s`` while
  the gateway's writes wait for it is cut (``stall.py``); the request it was served is told as
  of any disconnect.
Bodies are bounded by size and time in the application (``read_body``).

And one saving on every response: a response with a ``content-length`` (every whole JSON
reply) goes out in one write, head and body together, instead of uvicorn's two (one system call
and one TCP segment less per request; see :class:`CoalescingCycle`). The usual such response
(sent whole, no hop-by-hop headers) is framed here in one pass, with uvicorn's header checks;
anything else goes through uvicorn's own ``send``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gpupool.gateway.api.lane import Lane
from gpupool.gateway.api.middleware import content_length, too_large
from gpupool.gateway.api.stall import WriteStall, reset
from gpupool.gateway.errors import RequestTimeout

if TYPE_CHECKING:
    from gpupool.gateway.api.front import Front

log = logging.getLogger("gpupool.api")


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized head."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    head_timeout_s = 10.0
    max_head_bytes = 64 * 1024
    write_timeout_s = 60.0
    write_min_bytes = 16 * 1024
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _in_head = False
    _idle_since: float | None = None  # when the last response completed; None while busy
    _idle_timer: asyncio.TimerHandle | None = None
    _front: Front | None = None  # the lane's front door; None: every request through ASGI
    _body_timer: asyncio.TimerHandle | None = None
    # the request whose task runs (a lane or an ASGI cycle): no longer ``cycle`` if pipelined
    _serving: Lane | RequestResponseCycle | None = None
    _stall: WriteStall | None = None  # made the first time writes pause

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        from gpupool.gateway.api.front import Front

        app = self.app
        if (
            isinstance(app, Front)
            and not self.access_log
            and not self.root_path
            and self.limit_concurrency is None
        ):
            self._front = app

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._stop_body_timer()
        if self._stall is not None:
            self._stall.resumed()
        # uvicorn tells only the newest request; one still serving an earlier one must hear
        # it too (its stream stops, its worker connection is dropped).
        serving, current = self._serving, cast(object, self.cycle)
        if serving is not None and serving is not current and not serving.response_complete:
            serving.disconnected = True
        super().connection_lost(exc)

    # ---- keep-alive: one timer per connection -----------------------------------------------
    # uvicorn arms a keep-alive timer when a response completes and cancels it when the next
    # request's bytes arrive: two timer operations per request. Here one timer per connection
    # either lapses (a request is in flight) or moves itself to the idle deadline; it closes the
    # connection once nothing has arrived for ``timeout_keep_alive`` seconds since the last
    # response, as uvicorn's does.

    def on_response_complete(self) -> None:
        """uvicorn 0.54's ``on_response_complete``, with the timer above."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_check)

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # bytes arrived, or the connection went: not idle
        super()._unset_keepalive_if_required()

    def _idle_check(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return  # busy: the next completed response arms it again
        due = since + self.timeout_keep_alive
        if due - self.loop.time() <= 0.001:
            self.timeout_keep_alive_handler()
        else:
            self._idle_timer = self.loop.call_at(due, self._idle_check)

    # ---- a client that stops reading (``stall.py``) -----------------------------------------

    def pause_writing(self) -> None:
        self.flow.pause_writing()
        stall = self._stall
        if stall is None:
            stall = self._stall = WriteStall(
                self.loop, self.transport, self.write_timeout_s, self._write_stalled,
                self.write_min_bytes,
            )  # fmt: skip
        stall.paused()

    def resume_writing(self) -> None:
        self.flow.resume_writing()
        if self._stall is not None:
            self._stall.resumed()

    def _write_stalled(self) -> None:
        """Its client took too little in ``write_timeout_s``: cut. A request being served hears
        it as a disconnect, and the front door, watching it, logs the line with its id."""
        if not self._tell_stall():
            host, port = self.client or ("-", 0)
            log.warning(
                "cut a connection from %s:%s: its client took under %d bytes of a reply in "
                "%g s (server.write_min_bytes, server.write_timeout_s)",
                host, port, self.write_min_bytes, self.write_timeout_s,
            )  # fmt: skip
        reset(self.transport)

    def _tell_stall(self) -> bool:
        """Mark the request in flight as stalled; whether the front door will log it."""
        serving = self._serving
        cycle: object = self.cycle
        if serving is not None and not serving.response_complete:
            cycle = serving
        if isinstance(cycle, (Lane, CoalescingCycle)) and not cycle.response_complete:
            return cycle.stall(self.write_timeout_s)
        return False

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if self._head_bytes > self.max_head_bytes:  # our callback stopped the parser
            self._send_431()
        else:
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        """uvicorn's, but the ASGI scope is built only for a request that goes through ASGI."""
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._head_bytes = 0
        self._in_head = True

    def _new_scope(self) -> Any:
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def data_received(self, data: bytes) -> None:
        # uvicorn 0.54's, inlined: its keep-alive task is never armed here (the idle timer
        # above), so what it cancels first is ``_idle_since``.
        self._idle_since = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        if self._in_head:  # a head split across reads: from now on it has a deadline
            self._arm()
        lane: object = self.cycle
        if type(lane) is Lane and lane.task is None:
            self._settle(lane)  # its body is still arriving (or it was refused)

    # The head's size is counted inline, and uvicorn's callbacks are written out here (no
    # second call per header: the OpenAI client sends a dozen).
    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.max_head_bytes:
            raise HeadTooLarge
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.max_head_bytes:
            raise HeadTooLarge
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._disarm()
        if self._front is not None and self._to_lane(self._front):
            return
        self.scope = self._new_scope()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and type(cycle) is RequestResponseCycle:
            # Its task has not run yet: it looks ``send`` up on the class when it starts.
            cycle.__class__ = CoalescingCycle

    # ---- the lane (``lane.py``) ----------------------------------------------------------------

    def _to_lane(self, front: Front) -> bool:
        """Take the request onto the lane if it is a plain POST to a pipeline route."""
        parser, url = self.parser, self.url
        if (
            b"?" in url
            or b"%" in url
            or not url.startswith(b"/")
            or parser.get_http_version() != "1.1"
            or parser.should_upgrade()
            or not url.isascii()
        ):
            return False
        lane = Lane(
            self.transport, self.flow, url.decode("ascii"), self.headers,
            parser.should_keep_alive(), self.server_state.default_headers,
            self.on_response_complete,
        )  # fmt: skip
        if not front.head(lane, parser.get_method()):
            return False
        if lane.error is None:
            declared = content_length(self.headers)
            if declared is not None and declared > front.server.max_body_bytes:
                lane.error = too_large(front.server.max_body_bytes)
                lane.closing = True
        lane.expect_continue = self.expect_100_continue
        existing = self.cycle
        self.cycle = lane  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            lane.ready = True
        else:  # pipelined: it waits for the responses before it (``_start_asgi_task``)
            self.flow.pause_reading()
            self.pipeline.appendleft((lane, None))  # type: ignore[arg-type]
        return True

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is Lane:
            cycle.ready = True
            self._settle(cycle)
        else:
            self._serving = cycle
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        lane: object = self.cycle
        if type(lane) is not Lane:
            super().on_body(body)
            return
        if lane.closing or lane.response_started:
            return
        lane.size += len(body)
        front = self._front  # set: a lane exists only when it is
        assert front is not None
        if lane.size > front.server.max_body_bytes:
            lane.error = too_large(front.server.max_body_bytes)
            lane.closing = True
            lane.body.clear()
            return
        lane.body.append(body)

    def on_message_complete(self) -> None:
        lane: object = self.cycle
        if type(lane) is not Lane:
            super().on_message_complete()
            return
        lane.complete = True
        self._settle(lane)

    def _settle(self, lane: Lane) -> None:
        """Start the lane's task, refuse it, or give its body a deadline, as things stand."""
        if not lane.ready or lane.task is not None or lane.response_started:
            return
        if self.transport.is_closing():
            return
        front = self._front  # set: a lane exists only when it is
        assert front is not None
        if lane.complete and not lane.closing:
            self._stop_body_timer()
            self._serving = lane
            lane.start(self.loop, front.serve_lane(lane), self.tasks)
        elif lane.error is not None and (lane.closing or not lane.complete):
            self._stop_body_timer()
            front.refuse(lane)
        else:
            if lane.expect_continue:  # its turn has come: ask for the body (once)
                lane.expect_continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(
                    front.server.body_timeout_s, self._body_late
                )

    def _body_late(self) -> None:
        self._body_timer = None
        lane: object = self.cycle
        if type(lane) is Lane and not lane.complete and lane.task is None:
            lane.error = RequestTimeout("The request body did not arrive in time.")
            lane.closing = True
            self._settle(lane)

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _send_431(self) -> None:
        body = (
            b'{"error":{"message":"Request header fields too large.",'
            b'"type":"BadRequestError","param":null,"code":431}}'
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()


class _Buffered:
    """Stands in for the transport while uvicorn writes a response head and body."""

    __slots__ = ("closed", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class CoalescingCycle(RequestResponseCycle):
    """uvicorn's request cycle, holding back the head of a sized response until its body.

    uvicorn writes ``http.response.start`` and each body message separately. A response that
    declares its ``content-length`` is sent whole right after its start (gpupool never streams
    a sized body), so the head waits for the first body message and both go out in one write.
    Streams (no content-length) keep their immediate head.
    """

    _held: Any = None
    _on_disconnect: Callable[[], None] | None = None
    stalled = 0.0  # > 0: cut after its client took too little in this many seconds

    def stall(self, seconds: float) -> bool:
        """Its client took too little in ``seconds``: it is being cut. Whether the front door
        watches it (and logs the cut, with the request's id)."""
        self.stalled = seconds
        return self._on_disconnect is not None

    # uvicorn's protocol sets ``cycle.disconnected = True`` when the client goes away before
    # the response is complete. Seen through this property, that moment can call back, so the
    # front door needs no task per request waiting on ``receive()`` for ``http.disconnect``.
    @property
    def disconnected(self) -> bool:
        return bool(self.__dict__.get("disconnected", False))

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        self.__dict__["disconnected"] = value
        callback = self._on_disconnect
        if value and callback is not None:
            self._on_disconnect = None
            callback()

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once if the client disconnects (at once if it already has);
        ``None`` stops watching."""
        if callback is not None and self.disconnected:
            callback()
        else:
            self._on_disconnect = callback

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.response_started and _sized(message):
            self._held = message
            return
        held = self._held
        if held is None or kind != "http.response.body":
            await super().send(message)
            return
        self._held = None
        if not message.get("more_body", False) and self._plain():
            data = self._whole(held, message.get("body", b""))
            if data is not None:
                self._finish(data)
                return
        await self._coalesced(held, message)

    def _plain(self) -> bool:
        """Nothing that uvicorn's own send handles specially: no access log line, no HEAD, no
        paused writes, a client still there."""
        return not (
            self.access_log
            or self.flow.write_paused
            or self.disconnected
            or self.scope["method"] == "HEAD"
        )

    def _whole(self, start: Any, body: bytes) -> bytes | None:
        """Head and body as one buffer, with uvicorn's header checks; ``None`` for anything
        uvicorn's send must handle (bad headers, framing or connection headers, a body whose
        length is not the declared one, a status without a body)."""
        status = start["status"]
        if status < 200 or status == 204 or status == 304:
            return None
        content = [STATUS_LINE[status]]
        length = -1
        for name, value in (*self.default_headers, *start.get("headers", ())):
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                return None  # uvicorn raises, as it should
            name = name.lower()
            if name == b"content-length":
                if length < 0:
                    length = int(value) if value.isdigit() else -2
            elif name == b"transfer-encoding" or name == b"connection":
                return None
            content += (name, b": ", value, b"\r\n")
        if length != len(body):
            return None
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", body)
        return b"".join(content)

    def _finish(self, data: bytes) -> None:
        """What uvicorn's send does for a start and a final body message, in one write."""
        self.response_started = True
        self.waiting_for_100_continue = False
        self.transport.write(data)
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    async def _coalesced(self, held: Any, message: Any) -> None:
        """uvicorn's send for both messages, its two writes caught and sent as one."""
        transport, buffered = self.transport, _Buffered()
        self.transport = buffered  # type: ignore[assignment]
        try:
            await super().send(held)
            await super().send(message)
        finally:
            self.transport = transport
            if buffered.parts:
                transport.write(b"".join(buffered.parts))
            if buffered.closed:
                transport.close()


def _sized(message: Any) -> bool:
    for name, _ in message.get("headers", ()):
        if name == b"content-length" or name.lower() == b"content-length":
            return True
    return False


def guarded_protocol(
    head_timeout_s: float,
    max_head_bytes: int,
    write_timeout_s: float = 60.0,
    write_min_bytes: int = 16 * 1024,
) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, with these limits."""
    limits = {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes,
              "write_timeout_s": write_timeout_s,
              "write_min_bytes": write_min_bytes}  # fmt: skip
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), limits)
