"""The bounds on what a worker sends, at the upstream client, against scripted raw servers.

Each limit fails the response with an ``UpstreamFailure`` whose ``limit`` names the config field
(the relay turns it into a 502 or a stream's error event: ``tests/gateway/test_hostile_worker``).
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator

import pytest

from gpupool.gateway.upstream.client import UpstreamFailure
from gpupool.gateway.upstream.http1 import Http1Pool
from gpupool.gateway.upstream.limits import WorkerLimits
from tests.gateway.upstream.test_upstream_http1 import SSE_HEAD, Reader, Worker, Writer, chunk, ok

pytestmark = pytest.mark.timing  # idle and total deadlines of a fraction of a second

LIMITS = WorkerLimits(max_head_bytes=4096, max_headers=20, max_interim=2, max_body_bytes=65536,
                      max_event_bytes=65536, total_s=0.4, idle_s=0.3)  # fmt: skip


@pytest.fixture
async def pool() -> AsyncIterator[Http1Pool]:
    p = Http1Pool(limits=LIMITS)
    yield p
    await p.close()


async def failure(pool: Http1Pool, url: str, stream: bool = False) -> UpstreamFailure:
    """The failure of one request read whole (or as a stream)."""
    with pytest.raises(UpstreamFailure) as e:
        resp = await pool.open("POST", url, b"{}", {}, stream)
        if stream:
            async for _ in resp.iter_raw():
                pass
        else:
            await resp.read()
    assert e.value.sent and not e.value.died  # never retried elsewhere: it may have run
    return e.value


def serve(data: bytes, then_wait: bool = True):  # type: ignore[no-untyped-def]
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(data)
        if then_wait:
            await w.wait_gone(reader)

    return handler


async def test_a_head_that_never_ends_is_cut_at_its_size(pool: Http1Pool) -> None:
    async def endless(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(10_000):
            writer.write(b"x-%d: %s\r\n" % (i, b"v" * 1000))
            await writer.drain()

    async with Worker(endless) as w:
        e = await failure(pool, w.url)
    assert e.limit == "upstream_max_head_bytes" and str(e).endswith("over 4096 bytes")


async def test_one_huge_header_is_cut_at_the_head_size(pool: Http1Pool) -> None:
    async with Worker(serve(ok(b"{}", b"x-big: " + b"a" * 100_000 + b"\r\n"))) as w:
        assert (await failure(pool, w.url)).limit == "upstream_max_head_bytes"


async def test_too_many_headers(pool: Http1Pool) -> None:
    extra = b"".join(b"x-%d: v\r\n" % i for i in range(30))
    async with Worker(serve(ok(b"{}", extra))) as w:
        assert (await failure(pool, w.url)).limit == "upstream_max_headers"


async def test_too_many_interim_responses(pool: Http1Pool) -> None:
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" * 3
    async with Worker(serve(hints + ok(b"{}"))) as w:
        assert (await failure(pool, w.url)).limit == "upstream_max_interim"
    async with Worker(serve(hints[: len(hints) * 2 // 3] + ok(b"{}"))) as w:  # two: fine
        resp = await pool.open("POST", w.url, b"{}", {})
        assert await resp.read() == b"{}"


async def test_a_whole_body_over_its_bound(pool: Http1Pool) -> None:
    async def endless(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(1000):
            writer.write(chunk(b"x" * 16384))
            await writer.drain()

    async with Worker(endless) as w:
        assert (await failure(pool, w.url)).limit == "upstream_max_body_bytes"
    declared = b"HTTP/1.1 200 OK\r\ncontent-length: 10000000\r\n\r\nxx"  # refused at once
    async with Worker(serve(declared)) as w:
        assert (await failure(pool, w.url)).limit == "upstream_max_body_bytes"


async def test_a_trickle_does_not_extend_a_whole_answers_deadline(pool: Http1Pool) -> None:
    async def trickle(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        for byte in ok(b'{"a": "' + b"x" * 200 + b'"}'):
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)  # far quicker than the deadline, every time

    async with Worker(trickle) as w:
        e = await failure(pool, w.url)
    assert e.limit == "upstream_total_timeout_s" and "no whole answer" in str(e)


async def test_a_streams_idle_deadline_runs_between_lines(pool: Http1Pool) -> None:
    """Bytes without a line end are no progress; a line every 0.1 s keeps a stream going well
    past the idle deadline (0.3 s)."""

    async def no_lines(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(SSE_HEAD)
        for _ in range(200):
            writer.write(chunk(b"a"))
            await writer.drain()
            await asyncio.sleep(0.02)

    async with Worker(no_lines) as w:
        e = await failure(pool, w.url, stream=True)
    assert e.limit == "upstream_read_timeout_s" and "a line of its stream" in str(e)

    async def lines(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        writer.write(SSE_HEAD)
        for i in range(8):
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await w.wait_gone(reader)

    async with Worker(lines) as w:
        resp = await pool.open("POST", w.url, b"{}", {}, True)
        got = b"".join([c async for c in resp.iter_raw()])
    assert got.count(b"data: ") == 8


@pytest.mark.parametrize("stream", [False, True])
async def test_an_encoded_answer_is_refused(pool: Http1Pool, stream: bool) -> None:
    body = gzip.compress(b'{"a": 1}')
    async with Worker(serve(ok(body, b"content-encoding: gzip\r\n"))) as w:
        e = await failure(pool, w.url, stream)
    assert e.limit == "content-encoding" and "`gzip`" in str(e)
    async with Worker(serve(ok(b"{}", b"content-encoding: identity\r\n"))) as w:
        assert await (await pool.open("POST", w.url, b"{}", {})).read() == b"{}"


async def test_surplus_after_a_complete_answer_leaves_it_whole(pool: Http1Pool) -> None:
    """Content-Length 20, then garbage and a second response in the same packet: the 20 bytes
    at once, and the connection is never reused."""
    body = b'{"id":"twenty-byte"}'
    async with Worker(serve(ok(body) + b"GARBAGE\r\nHTTP/1.1 200 OK\r\n\r\nevil")) as w:
        resp = await asyncio.wait_for(pool.open("POST", w.url, b"{}", {}), 5)
        assert await asyncio.wait_for(resp.read(), 5) == body
        await asyncio.wait_for(w.gone.wait(), 5)  # the gateway dropped the connection
