"""A stream's idle deadline is held while its worker holds its requests paused (a swap group's
``/sleep?mode=keep``: nothing comes, by design, until the wake), and runs again from the
resume; a whole answer's total deadline never moves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gpupool.gateway.upstream.http1 import Http1Pool, origin_of
from gpupool.gateway.upstream.limits import WorkerLimits
from tests.gateway.upstream.test_http1_limits import failure
from tests.gateway.upstream.test_upstream_http1 import SSE_HEAD, Reader, Worker, Writer, chunk, ok

pytestmark = pytest.mark.timing  # idle and total deadlines of a fraction of a second

LIMITS = WorkerLimits(total_s=0.6, idle_s=0.3)
INF = float("inf")


class Pause:
    """The swap group's side: an origin's requests paused (infinity) or resumed then."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}
        self.asked: set[str] = set()

    def __call__(self, origin: str) -> float:
        self.asked.add(origin)
        return self.since.get(origin, 0.0)


@pytest.fixture
async def pool() -> AsyncIterator[Http1Pool]:
    p = Http1Pool(limits=LIMITS)
    yield p
    await p.close()


def gap_then_lines(gap_s: float, head_first: bool = True):  # type: ignore[no-untyped-def]
    async def handler(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        if head_first:
            writer.write(SSE_HEAD + chunk(b"data: 0\n\n"))
            await writer.drain()
        await asyncio.sleep(gap_s)  # paused: nothing for over the idle deadline
        if not head_first:
            writer.write(SSE_HEAD)
        for i in range(1, 4):
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await w.wait_gone(reader)

    return handler


@pytest.mark.parametrize("head_first", [True, False])
async def test_a_paused_stream_outlives_its_idle_deadline(
    pool: Http1Pool, head_first: bool
) -> None:
    pause = Pause()
    pool.hold_by(pause)
    async with Worker(gap_then_lines(1.2, head_first)) as w:
        pause.since[origin_of(w.url)] = INF  # paused for the whole gap (4 idle deadlines)
        resp = await pool.open("POST", w.url, b"{}", {}, True)
        got = b"".join([c async for c in resp.iter_raw()])
    assert got.count(b"data: ") == (4 if head_first else 3)
    assert pause.asked == {origin_of(w.url)}


async def test_once_resumed_long_ago_the_idle_deadline_cuts_again(pool: Http1Pool) -> None:
    pause = Pause()
    pool.hold_by(pause)
    async with Worker(gap_then_lines(1.2)) as w:
        pause.since[origin_of(w.url)] = 1.0  # resumed at the clock's start: long past
        e = await failure(pool, w.url, stream=True)
    assert e.limit == "upstream_read_timeout_s"


async def test_a_pause_never_moves_a_whole_answers_total_deadline(pool: Http1Pool) -> None:
    async def late(w: Worker, reader: Reader, writer: Writer) -> None:
        await w.request(reader)
        await asyncio.sleep(1.5)
        writer.write(ok(b"{}"))
        await w.wait_gone(reader)

    pause = Pause()
    pool.hold_by(pause)
    async with Worker(late) as w:
        pause.since[origin_of(w.url)] = INF
        e = await failure(pool, w.url)
    assert e.limit == "upstream_total_timeout_s"
