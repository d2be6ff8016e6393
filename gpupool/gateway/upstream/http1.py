"""A lean HTTP/1.1 client for the hot path to workers: asyncio protocols and ``httptools``.

aiohttp cost about a quarter of the gateway's CPU per request (a request object, a response
object, a stream reader, a timer per read, header multidicts), for a job that is small here: one
request head, one response parsed by llhttp, bytes passed on untouched. This module does only
that, with the behaviour of :class:`~gpupool.gateway.upstream.client.UpstreamClient`:

- :class:`Http1Pool` keeps idle keep-alive connections per origin (``scheme://host:port``), so
  ``abort(url)`` can cut one worker off at once, in flight and idle alike.
- ``open()`` returns an :class:`Http1Response` once the status and headers are in; the caller then
  reads the whole body or iterates raw chunks, and the connection goes back to the pool at the
  clean end of the body (or is dropped by ``close()``).
- Every failure is an :class:`UpstreamFailure` (``sent``: the request may have reached the
  worker; ``died``: the worker closed the connection), with a message that never contains the
  worker's address.

A connection taken from the idle pool that the worker had just closed (EOF or reset before any
response byte) is retried once on a fresh connection: uvicorn closes idle connections after 5 s,
and a request can cross that close on the wire.

A worker is only semi-trusted, so every read is bounded (:class:`WorkerLimits`, ``limits.py``):
the head's bytes and header count (interim ``1xx`` heads included) and the number of interim
heads; a body read whole; time, as a total deadline for a whole answer (from the send, never
restarted by a byte) or, for a stream, a deadline for its head and then between its lines (held
while the worker's requests are paused: :meth:`Http1Pool.hold_by`). Only
the headers a client needs are kept (``common.KEEP_RESPONSE``); the worker is asked for identity
encoding and an encoded answer is refused, so nothing downstream ever reads compressed bytes.
Bytes after a complete response end nothing but the connection's reuse: the answer stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import cast
from urllib.parse import quote, urlsplit

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

from gpupool.gateway.upstream.common import KEEP_RESPONSE_HEADERS as _KEEP
from gpupool.gateway.upstream.common import UpstreamFailure
from gpupool.gateway.upstream.limits import INF, WorkerLimits, over

Held = Callable[[str], float]  # an origin's last pause of its requests (inf: now; 0: never)
_PAUSE_AT = 256 * 1024  # unconsumed stream bytes at which the worker's socket stops being read
_NO_LIMIT = 1 << 62

# Connection states. A connection is in the idle pool only in _IDLE.
_IDLE = 0  # waiting in the pool (or just connected)
_HEAD = 1  # request sent, waiting for the status line and headers
_BODY = 2  # headers in, body arriving
_DONE = 3  # response complete; the body may still sit in the buffer
_FAILED = 4  # broken mid-response: ``exc`` says why


class _Stale(Exception):
    """A reused connection died before any response byte: the worker had closed it while idle."""


class _Over(Exception):
    """Raised in a parser callback to stop parsing: ``_Conn.broke`` says which limit."""


def _died(cause: str | None = "worker_died") -> UpstreamFailure:
    """The worker's connection closed mid-request; ``cause`` (see ``UpstreamFailure``): the
    worker itself closed it unless the gateway cut it (``Http1Pool.abort``)."""
    return UpstreamFailure("worker closed the connection", sent=True, died=True, cause=cause)


class _Origin:
    """One ``scheme://host:port``: where to connect, and its open and idle connections."""

    __slots__ = (
        "authority",
        "closed",
        "conns",
        "held_since",
        "host",
        "idle",
        "keepalive_s",
        "key",
        "max_idle",
        "port",
        "ssl",
    )

    def __init__(
        self, key: str, keepalive_s: float, max_idle: int, tls: Callable[[], ssl.SSLContext]
    ) -> None:
        parts = urlsplit(key)
        self.key = key
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("upstream URLs must be http:// or https:// with a host")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = f"{host}:{self.port}"
        self.ssl = tls() if parts.scheme == "https" else None
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self.conns: set[_Conn] = set()
        self.idle: deque[_Conn] = deque()
        self.closed = False
        self.held_since: Held | None = None  # the pool's (``Http1Pool.hold_by``)

    def take(self, now: float) -> _Conn | None:
        """The most recently used idle connection, unless it is too old for the worker to keep.

        The newest is checked first, so once one is too old all the others are older still.
        """
        idle = self.idle
        while idle:
            conn = idle.pop()
            since, conn.idle_since = conn.idle_since, 0.0
            if now - since > self.keepalive_s:
                conn.shut()
                while idle:
                    stale = idle.pop()
                    stale.idle_since = 0.0
                    stale.shut()
                return None
            if not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    def give_back(self, conn: _Conn) -> None:
        if not self.closed and conn.reusable() and len(self.idle) < self.max_idle:
            conn.to_idle()
            self.idle.append(conn)
        else:
            conn.shut()

    def forget(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        if conn.idle_since:
            conn.idle_since = 0.0
            with contextlib.suppress(ValueError):
                self.idle.remove(conn)

    def cut(self, cause: str | None = None) -> None:
        """Fail every in-flight request and close every connection, now (``cause``: see
        ``UpstreamFailure``; None, the default, lets none continue elsewhere)."""
        self.closed = True
        conns, self.conns = self.conns, set()
        self.idle.clear()
        for conn in conns:
            conn.idle_since = 0.0
            conn.fail(_died(cause))


class _Conn(asyncio.Protocol):
    """One TCP connection to a worker, and the state of the response on it.

    The parser calls back into this object; body chunks are buffered here and handed to the
    :class:`Http1Response` in one piece per wake-up, so a fast stream costs one future per
    batch rather than a queue item per chunk. The read timeout is checked lazily: one timer per
    connection, armed by the first request and left running across requests; when it fires it
    reschedules itself to the last byte's time plus the timeout while a response is awaited, and
    lapses once none is (so a request on a kept-alive connection arms and cancels nothing).
    """

    __slots__ = (
        "_buffered",
        "_cap",
        "_chunks",
        "_deadline",
        "_declared",
        "_encoding",
        "_framed",
        "_head_bytes",
        "_head_only",
        "_hsize",
        "_interim",
        "_keep",
        "_last_read",
        "_lim",
        "_limit",
        "_loop",
        "_nheaders",
        "_origin",
        "_parser",
        "_paused",
        "_stream",
        "_timer",
        "_waiter",
        "broke",
        "ctype",
        "exc",
        "got_bytes",
        "headers",
        "idle_since",
        "reused",
        "state",
        "status",
        "transport",
    )
    transport: asyncio.Transport

    def __init__(
        self, origin: _Origin, loop: asyncio.AbstractEventLoop, limits: WorkerLimits
    ) -> None:
        self._origin = origin
        self._loop = loop
        self._lim = limits
        self._parser = HttpResponseParser(self)
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._limit = _PAUSE_AT
        self._paused = False
        self._framed = False
        self._head_only = False
        self._keep = False
        self._last_read = 0.0  # a stream's body: when its last line ended (the idle clock)
        self._deadline = INF  # the fixed deadline: a whole answer's, or a stream head's
        self._stream = False  # the request streams: its body runs on the idle clock
        self._cap = _NO_LIMIT  # the most body bytes buffered (``limit_whole``)
        self._head_bytes = 0  # bytes fed while the head (and any 1xx before it) was not done
        self._hsize = 0  # the head's header bytes, exactly (1xx heads included)
        self._nheaders = 0
        self._interim = 0
        self._declared = -1  # Content-Length, when given
        self._encoding = b""  # a Content-Encoding other than identity
        self.broke: UpstreamFailure | None = None  # the limit a parser callback found crossed
        self.state = _IDLE
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.ctype = ""
        self.exc: BaseException | None = None
        self.got_bytes = False
        self.reused = False
        self.idle_since = 0.0  # when it went idle; 0 while out of the pool

    # ---- asyncio protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.state != _HEAD and self.state != _BODY:
            self._keep = False  # bytes nobody asked for: this connection cannot be trusted
            if self.state == _IDLE:
                self.transport.close()
            return
        self.got_bytes = True
        head = self.state == _HEAD
        if head:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except (HttpParserError, HttpParserUpgrade):
            # after a complete response (surplus bytes): the answer stands, the reader wakes
            self.fail(self.broke or UpstreamFailure("worker sent an invalid response", sent=True))
            self._wake()
            return
        if head and self.state == _HEAD and self._head_bytes > self._lim.max_head_bytes:
            self.fail(self._head_over())  # every byte so far was head: the head alone is over
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._keep = False
        self._origin.forget(self)
        if self.state != _HEAD and self.state != _BODY:
            self._stop_timer()
        elif self.state == _HEAD:
            self.fail(_Stale() if self.reused and not self.got_bytes else _died())
        elif self.state == _BODY:
            if exc is None and not self._framed:
                self._complete(False)  # a body without length or chunking ends at EOF
                self._wake()
            else:
                self.fail(_died())

    # ---- parser callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state != _HEAD:
            return  # a response nobody asked for, after the one that was: never kept
        self._nheaders += 1
        self._hsize += len(name + value) + 4  # (one call, not two: once per header)
        if self._hsize > self._lim.max_head_bytes:
            self._stop(self._head_over())
        if self._nheaders > self._lim.max_headers:
            n = self._lim.max_headers
            self._stop(over("upstream_max_headers", f"worker sent over {n} response headers"))
        low = name.lower()
        if low == b"content-length":
            self._framed = True
            self._declared = int(value)  # llhttp refuses a Content-Length that is no number
        elif low == b"transfer-encoding":
            self._framed = self._framed or b"chunked" in value.lower()
        elif low == b"content-encoding" and value.strip().lower() != b"identity":
            self._encoding = value.strip()[:32]
        elif low in _KEEP:
            if low == b"content-type":
                self.ctype = value.decode("latin-1")
            self.headers.append((low.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self.state != _HEAD:
            self._keep = False
            return
        status = self._parser.get_status_code()
        if status < 200:  # an interim response (103 Early Hints): the real one follows
            self._interim += 1
            if self._interim > self._lim.max_interim:
                n = self._lim.max_interim
                self._stop(over("upstream_max_interim", f"worker sent over {n} 1xx responses"))
            self.headers = []
            self.ctype = ""
            self._framed = False
            self._encoding = b""
            return
        if self._encoding and not self._head_only:
            enc = self._encoding.decode("latin-1")
            what = f"worker sent a `{enc}`-encoded answer (the gateway asks for identity)"
            self._stop(over("content-encoding", what))
        self.status = status
        self.state = _BODY
        if self._stream:  # the head is in: from now on the idle clock, between lines
            self._deadline = INF
            self._last_read = self._loop.time()
            self._arm(self._last_read + self._lim.idle_s)
        if self._head_only:
            # llhttp cannot be told the request was HEAD, so it would wait for the body that
            # Content-Length announces: end the response here and parse the next on a new parser.
            self._complete(self._parser.should_keep_alive())
            self._parser = HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        if self.state != _BODY:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._stream and b"\n" in body:
            self._last_read = self._loop.time()  # a line ended: the stream is moving
        if self._buffered > self._limit and not self._paused:
            if self._buffered > self._cap:
                self._stop(self._over_body())
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.state == _BODY:
            self._complete(self._parser.should_keep_alive())

    # ---- used by the pool and the response ------------------------------------------------

    def send(self, data: bytes, head_only: bool, stream: bool) -> None:
        """Start one exchange: reset the response state, write the request.

        The deadline runs from now: a whole answer's total deadline, or a stream head's (then
        the idle clock, from ``on_headers_complete``). A timer left from an earlier request
        that fires first moves itself to the deadline (see :meth:`_check_timeout`)."""
        self.state = _HEAD
        self.status = 0
        self.headers = []
        self.ctype = ""
        self.exc = None
        self.broke = None
        self.got_bytes = False
        self._framed = False
        self._head_only = head_only
        self._stream = stream
        self._limit = _PAUSE_AT
        self._cap = _NO_LIMIT
        self._head_bytes = self._hsize = self._nheaders = self._interim = 0
        self._declared = -1
        self._encoding = b""
        now = self._last_read = self._loop.time()
        lim = self._lim
        self._deadline = now + (lim.idle_s if stream else lim.total_s)
        self._arm(self._deadline)
        self.transport.write(data)

    def wait(self) -> asyncio.Future[None]:
        """Done at the next batch of bytes, the end of the response, or a failure (a future,
        awaited by the caller: no coroutine per wait)."""
        waiter = self._waiter = self._loop.create_future()
        return waiter

    def take_body(self) -> bytes:
        """Everything buffered so far, in one piece; reading resumes if it was paused."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._last_read = self._loop.time()
            self.transport.resume_reading()
        return data

    def has_body(self) -> bool:
        return bool(self._chunks)

    def limit_whole(self) -> None:
        """The whole body is wanted at once: never pause reading for it, but fail the answer
        once it is over ``max_body_bytes``."""
        self._limit = self._cap = self._lim.max_body_bytes
        if self._declared > self._cap or self._buffered > self._cap:
            self.fail(self._over_body())
        elif self._paused:
            self._paused = False
            self.transport.resume_reading()

    def reusable(self) -> bool:
        return self.state == _DONE and self._keep and not self.transport.is_closing()

    def to_idle(self) -> None:
        self.state = _IDLE
        self._chunks.clear()
        self.idle_since = time.monotonic()

    def fail(self, exc: BaseException) -> None:
        """End the response in flight (if any) with ``exc`` and drop the connection."""
        self._keep = False
        if self.state == _HEAD or self.state == _BODY:
            self.state = _FAILED
            self.exc = exc
            self._chunks.clear()
            self._buffered = 0
            self._stop_timer()
            self._wake()
        self.transport.abort()

    def shut(self) -> None:
        """Close a connection with no response in flight, gracefully."""
        self._keep = False
        self._stop_timer()
        self.transport.close()

    # ---- internals ------------------------------------------------------------------------

    def _stop(self, failure: UpstreamFailure) -> None:
        """In a parser callback: a limit is crossed; ``data_received`` fails the response."""
        self.broke = failure
        raise _Over

    def _head_over(self) -> UpstreamFailure:
        cap = self._lim.max_head_bytes
        return over("upstream_max_head_bytes", f"worker sent a response head over {cap} bytes")

    def _over_body(self) -> UpstreamFailure:
        cap = self._lim.max_body_bytes
        return over("upstream_max_body_bytes", f"worker sent an answer over {cap} bytes")

    def _arm(self, due: float) -> None:
        """The timer fires at ``due`` at the latest (one already earlier stays)."""
        timer = self._timer
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._timer = self._loop.call_at(due, self._check_timeout)

    def _complete(self, keep: bool) -> None:
        self.state = _DONE  # the read timer stays: it lapses by itself, or serves the next request
        self._keep = keep

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        self._timer = None
        if self.state != _HEAD and self.state != _BODY:
            return
        now = self._loop.time()
        due, lim = self._deadline, self._lim
        if due == INF:  # a stream's body: the idle clock
            if self._paused:  # our consumer is behind, not the worker: a fresh period
                self._last_read = now
            due = self._last_read + lim.idle_s
        if due - now <= 0.001 and self._stream:
            due = self._held(due, now)
        if due - now > 0.001:
            self._timer = self._loop.call_at(due, self._check_timeout)
        elif self._stream:
            phase = "its head" if self.state == _HEAD else "a line of its stream"
            what = f"worker timed out: no {phase} in {lim.idle_s:g} s"
            self.fail(over("upstream_read_timeout_s", what, "timeout"))
        else:
            what = f"worker timed out: no whole answer in {lim.total_s:g} s"
            self.fail(over("upstream_total_timeout_s", what, "timeout"))

    def _held(self, due: float, now: float) -> float:
        """A stream's idle deadline, moved to ``idle_s`` after the last time its worker held
        its requests: a swap group's pause (``/sleep?mode=keep``) sends nothing, by design,
        until the wake that resumes them. A whole answer's total deadline never moves."""
        held_since = self._origin.held_since
        if held_since is None:
            return due
        held = min(held_since(self._origin.key), now)
        if held <= due - self._lim.idle_s:
            return due
        due = held + self._lim.idle_s
        if self._deadline != INF:
            self._deadline = due  # (its head's)
        return due


class Http1Response:
    """A worker's response: status and headers now, the body by ``read()`` or ``iter_raw()``.

    Holds its connection until the body has been consumed (then returns it to the pool) or
    until ``close()`` (then drops it, so the worker sees the disconnect and aborts the request).
    """

    __slots__ = ("_body", "_conn", "_origin", "content_type", "headers", "status")

    def __init__(self, conn: _Conn, origin: _Origin) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self.content_type = conn.ctype
        self._conn: _Conn | None = conn
        self._origin = origin
        self._body: bytes | None = None

    def read_now(self) -> bytes | None:
        """The whole body if it is in already (kept, as ``read``'s), else None."""
        conn = self._conn
        if self._body is None and conn is not None and conn.state == _DONE:
            self._body = conn.take_body()
            self._release()
        return self._body

    async def read(self) -> bytes:
        """The whole body (kept, so a second call returns it again)."""
        if self._body is not None:
            return self._body
        conn = self._attached()
        conn.limit_whole()
        try:
            while conn.state == _BODY:
                await conn.wait()
        except BaseException:
            self.close()
            raise
        if conn.state != _DONE:
            self._conn = None
            raise conn.exc or _died()
        self._body = conn.take_body()
        self._release()
        return self._body

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives: chunked framing removed, bytes otherwise untouched."""
        if self._body is not None:
            return
        conn = self._attached()
        done = False
        try:
            while True:
                if conn.has_body():
                    yield conn.take_body()
                    if self._conn is not conn:  # closed while the chunk was being handled
                        raise UpstreamFailure("the response was closed", sent=True)
                elif conn.state == _BODY:
                    await conn.wait()
                elif conn.state == _DONE:
                    done = True
                    return
                else:
                    raise conn.exc or _died()
        finally:
            if done:
                self._body = b""
                self._release()
            else:
                self.close()

    def close(self) -> None:
        """Drop the connection now; it is never returned to the pool. Idempotent."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.fail(UpstreamFailure("the response was closed", sent=True))

    def __del__(self) -> None:
        # A response dropped unread (a cancelled caller) must not leave its connection open.
        if self._conn is not None:
            with contextlib.suppress(Exception):  # the loop may be gone already
                self._conn.transport.abort()

    def _attached(self) -> _Conn:
        if self._conn is None:
            raise UpstreamFailure("the response was closed", sent=True)
        return self._conn

    def _release(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._origin.give_back(conn)


class Http1Pool:
    """Keep-alive connections to workers, pooled per origin."""

    __slots__ = (
        "_connect_timeout_s",
        "_held",
        "_idle_keepalive_s",
        "_limits",
        "_max_idle",
        "_origins",
        "_tls",
    )

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        idle_keepalive_s: float = 4.0,
        max_idle_per_origin: int = 256,
        limits: WorkerLimits | None = None,
    ) -> None:
        """Without ``limits``, ``read_timeout_s`` is both deadlines, the defaults the rest."""
        self._connect_timeout_s = connect_timeout_s
        if limits is None:
            limits = WorkerLimits(idle_s=read_timeout_s, total_s=read_timeout_s)
        self._limits = limits
        self._idle_keepalive_s = idle_keepalive_s
        self._max_idle = max_idle_per_origin
        self._origins: dict[str, _Origin] = {}
        self._tls: ssl.SSLContext | None = None
        self._held: Held | None = None

    def hold_by(self, held_since: Held) -> None:
        """Streams' idle deadlines run from ``held_since(origin)`` at the earliest: the last
        time that origin's worker held its requests paused (infinity while it does)."""
        self._held = held_since
        for origin in self._origins.values():
            origin.held_since = held_since

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | bytes,
        stream: bool = False,
    ) -> Http1Response:
        """Send a request; return once the status and headers are in. ``stream``: the answer
        is read as it comes (the idle deadline), not whole (the total deadline)."""
        key, target = _split(url)
        origin = self._origins.get(key)
        if origin is None:
            origin = _Origin(key, self._idle_keepalive_s, self._max_idle, self._tls_context)
            origin.held_since = self._held
            self._origins[key] = origin
        data = _request(method, target, origin.authority, headers, body)
        head_only = method == "HEAD"
        # time.monotonic(), not the loop's time: asyncio.get_running_loop() costs a getpid()
        # system call, and a reused connection needs no loop here.
        conn = origin.take(time.monotonic())
        reused = conn is not None
        while True:
            if conn is None:
                try:
                    conn = await self._connect(origin)
                except UpstreamFailure:
                    if reused:  # the first attempt may have reached a now dead worker
                        raise _died() from None
                    raise
            try:
                conn.send(data, head_only, stream)
                while conn.state == _HEAD:
                    await conn.wait()
            except BaseException:
                conn.fail(_died())
                raise
            if conn.state != _FAILED:
                return Http1Response(conn, origin)
            if not (conn.reused and isinstance(conn.exc, _Stale)):
                raise conn.exc or _died()
            # the worker closed it while idle; the request may have crossed that close: once
            # more, on a new connection (never reused, so never stale)
            conn = None

    def abort(self, url: str, cause: str | None = None) -> None:
        """Cut every connection to a worker's origin: its in-flight requests fail at once;
        with a ``cause`` (an operator's drain or restart) they may continue elsewhere."""
        origin = self._origins.pop(_split(url)[0], None)
        if origin is not None:
            origin.cut(cause)

    async def close(self) -> None:
        """Close every connection: in-flight requests fail, and none goes back to a pool."""
        origins, self._origins = self._origins, {}
        for origin in origins.values():
            origin.cut()
        await asyncio.sleep(0)  # let the transports run connection_lost

    def _tls_context(self) -> ssl.SSLContext:
        """One TLS context for every https origin: building one reads the system CA bundle."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def _connect(self, origin: _Origin) -> _Conn:
        loop = asyncio.get_running_loop()
        factory = functools.partial(_Conn, origin, loop, self._limits)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    factory, origin.host, origin.port, ssl=origin.ssl
                )
        except TimeoutError:
            raise UpstreamFailure("worker timed out", sent=False) from None
        except OSError:
            raise UpstreamFailure("worker unreachable", sent=False) from None
        if self._origins.get(origin.key) is not origin:
            conn.shut()  # aborted (or the pool closed) while connecting
            raise _died()
        origin.conns.add(conn)
        return conn


def origin_of(url: str) -> str:
    """``scheme://host:port`` of a worker URL: the pool's key for it."""
    return _split(url)[0]


def _split(url: str) -> tuple[str, str]:
    """``(scheme://host:port, /path?query)`` of a URL, without parsing it twice."""
    cut = url.find("/", url.find("//") + 2)
    if cut < 0:
        return url, "/"
    return url[:cut], url[cut:]


def _request(
    method: str,
    target: str,
    authority: str,
    headers: Mapping[str, str] | bytes,
    body: bytes | None,
) -> bytes:
    """The request head (and body) as one buffer, for one write. ``headers`` as bytes are
    header lines already checked for line breaks (the pipeline's, ``context.py``)."""
    if not (target.isascii() and target.isprintable()) or " " in target:
        target = quote(target, safe="/?#[]@!$&'()*+,;=:%~")
    if isinstance(headers, bytes):
        fields = headers
    else:
        text = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if text.count("\n") != len(headers) or text.count("\r") != len(headers):
            raise ValueError("a request header contains a line break")
        try:
            fields = text.encode("latin-1")
        except UnicodeEncodeError:
            fields = text.encode()
    # identity: no transform (or usage reader) ever sees compressed bytes; anything else is refused
    line = f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\naccept-encoding: identity\r\n"
    start = line.encode()
    if body is None:
        return b"%b%b\r\n" % (start, fields)
    return b"%b%bcontent-length: %d\r\n\r\n%b" % (start, fields, len(body), body)
