"""Load generators on raw keep-alive HTTP/1.1 connections (uvloop + httptools).

No HTTP client library on the measuring side: each connection is an ``asyncio.Protocol`` that
writes precomputed request bytes and timestamps the response as the parser completes it, so the
client's own cost stays in the low microseconds and the figures are the gateway's.

* :func:`sequential` one request at a time on one connection (added latency at c=1);
* :func:`open_loop`  requests sent on a fixed schedule whatever the answers do (max rate);
* :func:`streams`    SSE streams with every event timestamped (TTFT, inter-chunk gaps);
* :class:`IdleStreams` thousands of open streams held while memory is read.

Every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import httptools

now = time.perf_counter
STAMP = re.compile(rb"@(\d{10}\.\d{6})")  # bench/upstream.py's send time in paced chunks


def request_bytes(
    port: int, path: str, body: bytes, headers: dict[str, str] | None = None
) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"host: 127.0.0.1:{port}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass(slots=True)
class Answer:
    status: int
    sent: float
    done: float
    events: list[float] = field(default_factory=list)  # arrival time of each SSE event
    transit: list[float] = field(default_factory=list)  # arrival - the upstream's send stamp
    body: bytes = b""

    @property
    def latency(self) -> float:
        return self.done - self.sent


Done = Callable[["Conn", Answer | None], None]


class Conn(asyncio.Protocol):
    """One keep-alive connection, one request in flight at a time."""

    def __init__(self, keep_body: bool = False) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.keep_body = keep_body
        self.on_done: Done | None = None
        self.answer: Answer | None = None
        self.parts: list[bytes] = []
        self.tail = b""  # the last byte seen, to find a "\n\n" split across reads
        self.closed = False
        self.first: asyncio.Future[bool] | None = None  # set at the first SSE event

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.first is not None and not self.first.done():
            self.first.set_result(False)
        if self.answer is not None and self.on_done is not None:
            cb, self.answer = self.on_done, None
            cb(self, None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def send(self, req: bytes, on_done: Done) -> None:
        assert self.transport is not None and self.answer is None
        self.on_done = on_done
        self.parts, self.tail = [], b""
        self.answer = Answer(0, now(), 0.0)
        self.transport.write(req)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    # httptools callbacks
    def on_headers_complete(self) -> None:
        if self.answer is not None:
            self.answer.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        a = self.answer
        if a is None:
            return
        t = now()
        n = (self.tail + body).count(b"\n\n")
        if n:
            a.events.extend([t] * n)
            if b"@" in body:
                a.transit += [t - float(m) for m in STAMP.findall(body)]
            if self.first is not None and not self.first.done():
                self.first.set_result(True)
        self.tail = body[-1:]
        if self.keep_body:
            self.parts.append(body)

    def on_message_complete(self) -> None:
        a, cb = self.answer, self.on_done
        if a is None or cb is None:
            return
        a.done = now()
        if self.keep_body:
            a.body = b"".join(self.parts)
        self.answer = None
        cb(self, a)


async def connect(port: int, keep_body: bool = False) -> Conn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: Conn(keep_body), "127.0.0.1", port)
    return proto


async def fetch(conn: Conn, req: bytes, wait_s: float) -> Answer | None:
    fut: asyncio.Future[Answer | None] = asyncio.get_running_loop().create_future()

    def done(_: Conn, a: Answer | None) -> None:
        if not fut.done():
            fut.set_result(a)

    conn.send(req, done)
    try:
        return await asyncio.wait_for(fut, wait_s)
    except TimeoutError:
        conn.close()
        return None


# ---- c=1 ------------------------------------------------------------------------------------


async def sequential(port: int, req: bytes, n: int, wait_s: float = 10.0) -> list[float]:
    """Latencies (s) of ``n`` requests sent one after another on one connection."""
    conn = await connect(port)
    out: list[float] = []
    try:
        for _ in range(n):
            if conn.closed:
                conn = await connect(port)
            a = await fetch(conn, req, wait_s)
            if a is None or a.status != 200:
                raise RuntimeError(f"request failed: {a.status if a else 'no answer'}")
            out.append(a.latency)
    finally:
        conn.close()
    return out


# ---- open loop ------------------------------------------------------------------------------


@dataclass(slots=True)
class Step:
    rate: float
    sent: int = 0
    ok: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)  # how late each send left the client
    seconds: float = 0.0


class _Pool:
    def __init__(self, port: int, req: bytes, step: Step, max_conns: int) -> None:
        self.port, self.req, self.step, self.max_conns = port, req, step, max_conns
        self.idle: list[Conn] = []
        self.total = 0
        self.pending = 0
        self.connecting: set[asyncio.Task[None]] = set()

    async def warm(self, n: int) -> None:
        conns = await asyncio.gather(*(connect(self.port) for _ in range(n)))
        self.idle.extend(conns)
        self.total = n

    def fire(self) -> None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self.pending += 1
                conn.send(self.req, self.done)
                return
            self.total -= 1
        if self.total >= self.max_conns:
            self.step.errors += 1  # the client ran out of connections: the target is stuck
            return
        self.total += 1
        self.pending += 1
        task = asyncio.ensure_future(self._connect_and_send())
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)

    async def _connect_and_send(self) -> None:
        sent = now()
        try:
            conn = await connect(self.port)
        except OSError:
            self.pending -= 1
            self.total -= 1
            self.step.errors += 1
            return
        conn.send(self.req, self.done)
        assert conn.answer is not None
        conn.answer.sent = sent  # the connection set-up counts against the target

    def done(self, conn: Conn, a: Answer | None) -> None:
        self.pending -= 1
        if a is None or a.status != 200:
            self.step.errors += 1
            if a is not None:
                self.idle.append(conn)
            else:
                self.total -= 1
            return
        self.step.ok += 1
        self.step.latencies.append(a.latency)
        self.idle.append(conn)

    def close(self) -> None:
        for c in self.idle:
            c.close()
        for t in self.connecting:
            t.cancel()


async def open_loop(
    port: int,
    req: bytes,
    rate: float,
    seconds: float,
    *,
    max_conns: int = 4000,
    grace: float = 2.0,
    warm_conns: int | None = None,
) -> Step:
    """Send at ``rate`` per second for ``seconds`` on a schedule that never waits for answers.

    A request finds an idle connection or opens a new one (its set-up time counts). Requests still
    unanswered ``grace`` seconds after the last send are errors.
    """
    step = Step(rate)
    pool = _Pool(port, req, step, max_conns)
    await pool.warm(warm_conns or max(8, min(512, int(rate * 0.004))))
    n = int(rate * seconds)
    interval = 1.0 / rate
    start = now() + 0.01
    i = 0
    try:
        while i < n:
            t = now()
            while i < n and start + i * interval <= t:
                step.lags.append(t - (start + i * interval))
                pool.fire()
                i += 1
            if i < n:  # uvloop's timers tick in milliseconds: sleep at least one, never spin
                await asyncio.sleep(max(0.001, start + i * interval - now()))
        step.sent = i
        step.seconds = now() - start
        deadline = now() + grace
        while pool.pending > 0 and now() < deadline:  # noqa: ASYNC110 - bounded drain
            await asyncio.sleep(0.01)
        step.errors += max(0, pool.pending)
    finally:
        pool.close()
    return step


# ---- streams --------------------------------------------------------------------------------


async def streams(
    port: int, req: bytes, n: int, concurrency: int, stagger: float, wait_s: float = 30.0
) -> list[Answer | None]:
    """``n`` SSE streams, ``concurrency`` at a time, starts spread by ``stagger`` seconds."""
    out: list[Answer | None] = []
    queue = list(range(n))

    async def lane(k: int) -> None:
        await asyncio.sleep(k * stagger)
        conn = await connect(port, keep_body=True)
        try:
            while queue:
                queue.pop()
                if conn.closed:
                    conn = await connect(port, keep_body=True)
                out.append(await fetch(conn, req, wait_s))
        finally:
            conn.close()

    await asyncio.gather(*(lane(k) for k in range(concurrency)))
    return out


class IdleStreams:
    """Open SSE streams that are held open (each has received its first event)."""

    def __init__(self, port: int, req: bytes) -> None:
        self.port, self.req = port, req
        self.conns: list[Conn] = []
        self.failed = 0

    @property
    def alive(self) -> int:
        """Streams still open that have received at least their first event."""
        return sum(
            1
            for c in self.conns
            if not c.closed
            and c.first is not None
            and c.first.done()
            and not c.first.cancelled()
            and c.first.result()
        )

    async def open(self, n: int, deadline_s: float, parallel: int = 200) -> int:
        """Open ``n`` more streams; returns how many got their first event in time."""
        deadline = now() + deadline_s
        sem = asyncio.Semaphore(parallel)
        got = 0

        async def one() -> None:
            nonlocal got
            async with sem:
                if now() > deadline:
                    self.failed += 1
                    return
                try:
                    conn = await asyncio.wait_for(connect(self.port), max(0.1, deadline - now()))
                except (OSError, TimeoutError):
                    self.failed += 1
                    return
                self.conns.append(conn)
                conn.first = asyncio.get_running_loop().create_future()
                conn.send(self.req, lambda c, a: None)
                try:  # shielded: a late first event still counts the stream as open
                    ok = await asyncio.wait_for(
                        asyncio.shield(conn.first), max(0.1, deadline - now())
                    )
                except TimeoutError:
                    ok = False
                if ok:
                    got += 1
                else:
                    self.failed += 1

        await asyncio.gather(*(one() for _ in range(n)))
        return got

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns.clear()
