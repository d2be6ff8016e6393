"""The lean HTTP/1.1 upstream client against scripted servers on loopback ports.

Each test runs a tiny asyncio server whose handler writes exactly the bytes a worker would (or a
broken one might), so keep-alive reuse, chunked streams, mid-stream deaths, timeouts and the
keep-alive close race are all exercised on real sockets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
import uvloop

from gpupool.gateway.upstream.client import UpstreamFailure
from gpupool.gateway.upstream.http1 import Http1Pool, Http1Response
from tests.support.procs import free_port

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Handler = Callable[["Worker", Reader, Writer], Awaitable[None]]
JSON_HEADERS = {"content-type": "application/json", "x-trace": "t1"}
DIED = ("worker closed the connection", True, True)


def facts(e: UpstreamFailure) -> tuple[str, bool, bool]:
    """What a caller acts on: the message, whether the request may have run, and if it died."""
    return str(e), e.sent, e.died


class Worker:
    """A scripted HTTP/1.1 server: every connection runs ``handler``; connections are counted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.disconnects = 0
        self.heads: list[bytes] = []
        self.gone = asyncio.Event()  # set when a handler saw the client hang up
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Worker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: Reader, writer: Writer) -> None:
        self.connections += 1
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: Reader) -> bytes | None:
        """The next request's body (its head goes to ``heads``), or None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return await reader.readexactly(length)

    async def wait_gone(self, reader: Reader) -> None:
        """Block until the client closes its end."""
        while await reader.read(1024):
            pass
        self.disconnects += 1
        self.gone.set()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENTS = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


async def echo(w: Worker, reader: Reader, writer: Writer) -> None:
    """Answers every request on the connection with its number on it and the request body."""
    n = 0
    while (body := await w.request(reader)) is not None:
        n += 1
        writer.write(ok(orjson.dumps({"n": n, "body": body.decode()})))


async def slow_echo(w: Worker, reader: Reader, writer: Writer) -> None:
    while (body := await w.request(reader)) is not None:
        await asyncio.sleep(0.02)
        writer.write(ok(body))


async def sse(w: Worker, reader: Reader, writer: Writer) -> None:
    while await w.request(reader) is not None:
        writer.write(SSE_HEAD)
        for event in EVENTS:
            writer.write(chunk(event))
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")


async def head_then_wait(w: Worker, reader: Reader, writer: Writer) -> None:
    """Sends the head and one event, then holds the stream open until the client leaves."""
    await w.request(reader)
    writer.write(SSE_HEAD + chunk(EVENTS[0]))
    await w.wait_gone(reader)


@pytest.fixture
async def pool() -> AsyncIterator[Http1Pool]:
    p = Http1Pool(read_timeout_s=2.0)
    yield p
    await p.close()


async def body_of(resp: Http1Response) -> list[bytes]:
    return [piece async for piece in resp.iter_raw()]


# ---- bodies and keep-alive -------------------------------------------------------------------


async def test_json_body_read_and_connection_reused(pool: Http1Pool) -> None:
    async with Worker(echo) as w:
        first = await pool.open("POST", w.url + "/v1/chat?x=1", b'{"a":1}', JSON_HEADERS)
        assert (first.status, first.content_type) == (200, "application/json")
        assert orjson.loads(await first.read()) == {"n": 1, "body": '{"a":1}'}
        second = await pool.open("POST", w.url + "/v1/chat", b"", JSON_HEADERS)
        assert orjson.loads(await second.read()) == {"n": 2, "body": ""}
        assert w.connections == 1
    port = w.url.rsplit(":", 1)[1]
    head = w.heads[0].decode()
    assert head.startswith(f"POST /v1/chat?x=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n")
    assert "content-type: application/json\r\nx-trace: t1\r\ncontent-length: 7\r\n" in head
    assert "content-length: 0\r\n" in w.heads[1].decode()
    assert "user-agent" not in head.lower()
    assert "accept-encoding: identity\r\n" in head  # never a compressed answer


async def test_header_lines_as_bytes_go_out_as_they_are(pool: Http1Pool) -> None:
    async with Worker(echo) as w:
        lines = b"content-type: application/json\r\nx-trace: t2\r\n"
        await (await pool.open("POST", w.url + "/v1/chat", b"{}", lines)).read()
    assert w.heads[0].endswith(
        b"\r\ncontent-type: application/json\r\nx-trace: t2\r\ncontent-length: 2\r\n\r\n"
    )


def hello_world(pause_s: float) -> Handler:
    """A worker that answers every request with ``hello``, then ``world`` ``pause_s`` later
    (one content-length body of 10 bytes)."""

    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        while await w.request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello")
            await writer.drain()
            await asyncio.sleep(pause_s)
            writer.write(b"world")

    return handler


async def test_read_now_is_the_body_once_it_is_in_and_none_before(pool: Http1Pool) -> None:
    async with Worker(hello_world(0.05)) as w:
        resp = await pool.open("GET", w.url, None, {})
        assert resp.read_now() is None  # half of it is in
        assert await resp.read() == b"helloworld"
        assert resp.read_now() == b"helloworld"  # kept, as read's
        again = await pool.open("GET", w.url, None, {})
        # until "world" is in (0.05 s later, or more on a loaded machine: a fixed 0.2 s could
        # wake in the same loop turn as the worker's write, before the socket was read)
        for _ in range(500):
            if (now := again.read_now()) is not None:
                break
            await asyncio.sleep(0.02)
        assert now == b"helloworld" == await again.read()
        assert w.connections == 1  # read_now gave the connection back to the pool


async def test_get_without_body_sends_no_content_length(pool: Http1Pool) -> None:
    async with Worker(echo) as w:
        await (await pool.open("GET", w.url, None, {})).read()
    assert w.heads[0].startswith(b"GET / HTTP/1.1\r\n")
    assert b"content-length" not in w.heads[0]


async def test_chunked_sse_arrives_in_pieces_and_connection_is_reused(pool: Http1Pool) -> None:
    async with Worker(sse) as w:
        resp = await pool.open("POST", w.url + "/v1/completions", b"{}", JSON_HEADERS)
        assert resp.content_type == "text/event-stream"
        assert await body_of(resp) == EVENTS
        resp.close()  # after the clean end: a no-op, the connection is already pooled
        again = await pool.open("POST", w.url + "/v1/completions", b"{}", JSON_HEADERS)
        assert b"".join(await body_of(again)) == b"".join(EVENTS)
        assert w.connections == 1


async def test_content_length_body_streamed_untouched(pool: Http1Pool) -> None:
    async with Worker(hello_world(0.02)) as w:
        assert await body_of(await pool.open("GET", w.url, None, {})) == [b"hello", b"world"]
        assert await (await pool.open("GET", w.url, None, {})).read() == b"helloworld"
        assert w.connections == 1


async def test_no_body_responses_complete_and_keep_the_connection(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        replies = [
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\netag: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",  # to a HEAD
            ok(b"{}"),
        ]
        for reply in replies:
            await w.request(reader)
            writer.write(reply)
        await w.request(reader)

    async with Worker(handler) as w:
        no_content = await pool.open("DELETE", w.url, None, {})
        assert (no_content.status, await no_content.read()) == (204, b"")
        not_modified = await pool.open("GET", w.url, None, {})
        assert (not_modified.status, await not_modified.read()) == (304, b"")
        head = await pool.open("HEAD", w.url, None, {})
        assert (head.status, await body_of(head)) == (200, [])
        assert await (await pool.open("GET", w.url, None, {})).read() == b"{}"
        assert w.connections == 1


async def test_body_until_eof_is_read_and_connection_not_reused(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
        await writer.drain()

    async with Worker(handler) as w:
        assert await (await pool.open("GET", w.url, None, {})).read() == b"all of it"
        assert await (await pool.open("GET", w.url, None, {})).read() == b"all of it"
        assert w.connections == 2


async def test_interim_response_is_skipped_and_only_allowed_headers_kept(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
        extra = (
            b"Server: uvicorn\r\nDate: Mon, 01 Jan 2024 00:00:00 GMT\r\nConnection: keep-alive\r\n"
            b"Keep-Alive: timeout=5\r\nX-Request-Id: r1\r\n"
        )
        writer.write(ok(b"{}", extra))
        await w.request(reader)

    async with Worker(handler) as w:
        resp = await pool.open("GET", w.url, None, {})
        assert resp.headers == [("content-type", "application/json")]  # no x-request-id
        assert await resp.read() == b"{}"


async def test_slow_stream_consumer_pauses_reading_at_256_kib(pool: Http1Pool) -> None:
    size = 4 << 20

    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        while await w.request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
            for _ in range(size // 65536):
                writer.write(b"x" * 65536)
                await writer.drain()

    async with Worker(handler) as w:
        resp = await pool.open("GET", w.url, None, {})
        await asyncio.sleep(0.1)  # the consumer is slow: the socket is read no further
        assert resp._conn is not None and resp._conn._buffered < 1 << 20
        assert sum(map(len, await body_of(resp))) == size
        assert len(await (await pool.open("GET", w.url, None, {})).read()) == size
        assert w.connections == 1


async def test_idle_connection_the_worker_closed_leaves_the_pool(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()  # then close, as uvicorn does after its keep-alive timeout

    async with Worker(handler) as w:
        await (await pool.open("GET", w.url, None, {})).read()
        await asyncio.sleep(0.05)
        assert await (await pool.open("GET", w.url, None, {})).read() == b"{}"
        assert w.connections == 2


# ---- failures --------------------------------------------------------------------------------


async def test_connection_refused_is_not_sent(pool: Http1Pool) -> None:
    with pytest.raises(UpstreamFailure) as e:
        await pool.open("POST", f"http://127.0.0.1:{free_port()}/v1/x", b"{}", {})
    assert facts(e.value) == ("worker unreachable", False, False)


async def test_worker_closing_mid_stream_is_a_death(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()
        await asyncio.sleep(0.02)

    async with Worker(handler) as w:
        resp = await pool.open("POST", w.url, b"{}", {})
        pieces = []
        with pytest.raises(UpstreamFailure) as e:
            async for piece in resp.iter_raw():
                pieces.append(piece)
    assert pieces == [b"0123456789"]
    assert facts(e.value) == DIED


async def test_worker_closing_during_read_is_a_death(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"{"))

    async with Worker(handler) as w:
        resp = await pool.open("POST", w.url, b"{}", {})
        with pytest.raises(UpstreamFailure) as e:
            await resp.read()
    assert facts(e.value) == DIED


async def test_worker_closing_before_answering_is_a_death(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)

    async with Worker(handler) as w:
        with pytest.raises(UpstreamFailure) as e:
            await pool.open("POST", w.url, b"{}", {})
    assert facts(e.value) == DIED


async def test_invalid_response(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"SPDY/9 banana\r\n\r\n")
        await w.wait_gone(reader)

    async with Worker(handler) as w:
        with pytest.raises(UpstreamFailure) as e:
            await pool.open("GET", w.url, None, {})
    assert (str(e.value), e.value.sent) == ("worker sent an invalid response", True)


async def test_read_timeout_before_headers_and_between_chunks() -> None:
    pool = Http1Pool(read_timeout_s=0.15)

    async def silent(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        await w.wait_gone(reader)

    async with Worker(silent) as w:
        started = time.monotonic()
        with pytest.raises(UpstreamFailure) as e:
            await pool.open("POST", w.url, b"{}", {})
        # not before the deadline; after it, anything finite (the worker is silent for good),
        # with room for a loaded machine's stalls
        assert 0.14 < time.monotonic() - started < 10
        assert facts(e.value)[1:] == (True, False)
        assert str(e.value).startswith("worker timed out")
    async with Worker(head_then_wait) as w:
        resp = await pool.open("POST", w.url, b"{}", {})
        pieces = []
        with pytest.raises(UpstreamFailure, match="worker timed out"):
            async for piece in resp.iter_raw():
                pieces.append(piece)
        assert pieces == EVENTS[:1]
        await asyncio.wait_for(w.gone.wait(), 1)
    await pool.close()


async def test_abort_cuts_streams_and_idle_connections_at_once(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        while (body := await w.request(reader)) is not None:
            if body == b"stream":
                writer.write(SSE_HEAD + chunk(EVENTS[0]))
                break
            await asyncio.sleep(0.02)
            writer.write(ok(b"{}"))
        await w.wait_gone(reader)

    async with Worker(handler) as w:
        warm = [pool.open("POST", w.url, b"{}", {}) for _ in range(2)]
        for resp in await asyncio.gather(*warm):
            await resp.read()
        assert w.connections == 2  # both now idle in the pool
        resp = await pool.open("POST", w.url + "/v1/completions", b"stream", {})
        stream = resp.iter_raw()
        assert await anext(stream) == EVENTS[0]
        asyncio.get_running_loop().call_later(0.02, pool.abort, w.url + "/v1/other")
        started = time.monotonic()
        with pytest.raises(UpstreamFailure) as e:
            await anext(stream)
        # the abort, not the pool's 2 s read timeout, ended it (the bound leaves a loaded
        # machine's stalls 1.5 s; the error's facts say which it was)
        assert time.monotonic() - started < 1.9
        assert facts(e.value) == DIED
        for _ in range(50):
            if w.disconnects == 2:
                break
            await asyncio.sleep(0.01)
        assert w.disconnects == 2
        assert await (await pool.open("POST", w.url, b"{}", {})).read() == b"{}"  # fresh pool


async def test_idle_connection_closed_by_worker_is_retried_transparently(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(ok(b'"first"'))
        if w.connections == 1:
            await w.request(reader)  # the next request crossed the worker's idle close
            return
        while await w.request(reader) is not None:
            writer.write(ok(b'"again"'))

    async with Worker(handler) as w:
        assert await (await pool.open("POST", w.url, b"{}", {})).read() == b'"first"'
        assert await (await pool.open("POST", w.url, b"{}", {})).read() == b'"first"'
        assert w.connections == 2


async def test_idle_connections_older_than_keepalive_are_not_reused() -> None:
    pool = Http1Pool(idle_keepalive_s=0.05)
    async with Worker(echo) as w:
        await (await pool.open("GET", w.url, None, {})).read()
        await asyncio.sleep(0.1)
        assert orjson.loads(await (await pool.open("GET", w.url, None, {})).read())["n"] == 1
        assert w.connections == 2
    await pool.close()


async def test_close_mid_stream_lets_the_worker_see_the_disconnect(pool: Http1Pool) -> None:
    async with Worker(head_then_wait) as w:
        resp = await pool.open("POST", w.url, b"{}", {})
        stream = resp.iter_raw()
        assert await anext(stream) == EVENTS[0]
        resp.close()
        await asyncio.wait_for(w.gone.wait(), 1)
        with pytest.raises(UpstreamFailure):
            await anext(stream)


async def test_cancelled_request_drops_its_connection(pool: Http1Pool) -> None:
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        await w.wait_gone(reader)

    async with Worker(handler) as w:
        task = asyncio.create_task(pool.open("POST", w.url, b"{}", {}))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait_for(w.gone.wait(), 1)


async def test_fifty_concurrent_requests_on_one_origin(pool: Http1Pool) -> None:
    async def one(i: int) -> bytes:
        return await (await pool.open("POST", w.url, b"%d" % i, JSON_HEADERS)).read()

    async with Worker(slow_echo) as w:
        assert await asyncio.gather(*(one(i) for i in range(50))) == [b"%d" % i for i in range(50)]
        opened = w.connections
        assert await asyncio.gather(*(one(i) for i in range(50))) == [b"%d" % i for i in range(50)]
        assert w.connections == opened == 50  # the second wave ran on pooled connections


def test_works_on_uvloop() -> None:
    """The gateway runs on uvloop: keep-alive, streams and abort on its transports too."""

    async def scenario() -> None:
        pool = Http1Pool(read_timeout_s=2.0)
        async with Worker(sse) as w:
            for _ in range(2):
                resp = await pool.open("POST", w.url, b"{}", JSON_HEADERS)
                assert await body_of(resp) == EVENTS
            assert w.connections == 1
        async with Worker(head_then_wait) as w:
            stream = (await pool.open("POST", w.url, b"{}", {})).iter_raw()
            assert await anext(stream) == EVENTS[0]
            pool.abort(w.url)
            with pytest.raises(UpstreamFailure, match="closed the connection"):
                await anext(stream)
            await asyncio.wait_for(w.gone.wait(), 1)
        await pool.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_read_timeout_runs_from_each_request_on_a_reused_connection() -> None:
    """The read timer outlives a request on a kept-alive connection; the next request's deadline
    is still its own start plus the timeout, neither earlier nor never."""
    pool = Http1Pool(read_timeout_s=0.3)

    async def first_then_silent(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(ok(b'"first"'))
        await w.request(reader)
        await w.wait_gone(reader)

    async with Worker(first_then_silent) as w:
        assert await (await pool.open("POST", w.url, b"{}", {})).read() == b'"first"'
        await asyncio.sleep(0.2)  # the first request's timer is now due in about 0.1 s
        started = time.monotonic()
        with pytest.raises(UpstreamFailure) as e:
            await pool.open("POST", w.url, b"{}", {})
        assert time.monotonic() - started >= 0.29  # not the first request's deadline
        assert facts(e.value)[1:] == (True, False)
        assert str(e.value).startswith("worker timed out")
        assert w.connections == 1  # it was the reused connection that timed out
    await pool.close()
