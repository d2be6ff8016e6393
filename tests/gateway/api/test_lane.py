"""The request lane (``gateway/api/lane.py``): the token-bearing routes served straight from the
HTTP protocol, through a real ``gpupool serve`` process, read and written with raw sockets.

Each case is something the ASGI path did for these routes and the lane must still do: bodies
split across reads, pipelined requests answered in order, the body's size (413) and time (408)
limits, refused heads (401, 405) answered whether or not the body came, ``Expect:
100-continue``, streams with chunked framing, and a query string still served (through ASGI).
After each, nothing is held.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import gateway, running, sim

MODEL, SLOW = "m", "slow"
ADMIN, KEY = "sk-admin-lane", "sk-lane-1"
MAX_BODY = 4096
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}
LOGS: list[Path] = []  # the gateway's log


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("lane")
    w = sim(model=MODEL, tmp=tmp, max_num_seqs=16, mode="echo")
    slow = sim(model=SLOW, tmp=tmp, max_num_seqs=4, itl_ms=2000, output_tokens=20)
    cfg: dict[str, Any] = {
        # 2 s, not 1: a body sent 0.2 s after its head (or after a 100 Continue) is late only
        # if this process stalls 1.8 s, where at 1 s a 0.8-s stall made a false 408
        "server": {"max_body_bytes": MAX_BODY, "body_timeout_s": 2.0},
        "models": [{"name": MODEL}, {"name": SLOW}],
        "workers": [{"name": "w", "model": MODEL, "url": w.url, "max_inflight": 8},
                    {"name": "ws", "model": SLOW, "url": slow.url, "max_inflight": 4}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "k", "sha256": _h(KEY)}]},
    }  # fmt: skip
    g = gateway(cfg, tmp)
    LOGS.append(g.log_path)
    with running(w, slow), running(g):
        yield g.url


def _body(prompt: str = "hi", **extra: Any) -> bytes:
    import orjson

    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra})


def _head(path: str, body: bytes, key: str | None = KEY, extra: str = "") -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{auth}"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode()


async def _open(gw: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = gw.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower case), body (sized or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await asyncio.wait_for(reader.readline(), 10)).strip(), 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), 10)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = b""
    return status, headers, body


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 5) == b""


def test_body_split_across_reads_and_pipelined_requests_in_order(gw: str) -> None:
    async def go() -> None:
        reader, writer = await _open(gw)
        body = _body("first")
        writer.write(_head("/v1/completions", body) + body[:10])
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(body[10:])
        status, headers, data = await _response(reader)
        assert status == 200 and b"first" in data and headers["x-request-id"]
        # three requests in one write: three answers, in order, on the same connection
        bodies = [_body(p) for p in ("one", "two", "three")]
        writer.write(b"".join(_head("/v1/completions", b) + b for b in bodies))
        for word in (b"one", b"two", b"three"):
            status, _, data = await _response(reader)
            assert status == 200 and word in data
        writer.close()

    asyncio.run(go())
    assert_nothing_held(gw, ADMIN_HEADERS)


def test_a_reset_behind_pipelined_requests_ends_the_one_being_served_cleanly(gw: str) -> None:
    """A slow stream, a request pipelined behind it, then the client goes. Reading is paused
    while a request waits its turn, so the loss is seen only when a write fails (the second
    token after the close, 4 s later: TCP accepts the first); then the stream (no longer the
    connection's newest request) must end as a client that left, not as a failed write logged
    as an error."""

    async def go() -> None:
        reader, writer = await _open(gw)
        stream = _body("x", stream=True, max_tokens=20, model=SLOW)
        writer.write(_head("/v1/completions", stream) + stream)
        await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # the stream runs
        writer.write(_head("/v1/completions", _body()) + _body())
        await asyncio.sleep(0.2)
        writer.transport.abort()  # type: ignore[attr-defined]

    asyncio.run(go())
    # the stream's second token after the close (itl 2 s) fails its write by ~4 s; waited on up
    # to 15 s for a loaded machine, still far short of the stream's own end (20 tokens, 40 s)
    assert_nothing_held(gw, ADMIN_HEADERS, within_s=15.0)
    assert "unexpected error" not in LOGS[0].read_text(errors="replace")


def test_100_continue_waits_for_the_responses_before_it(gw: str) -> None:
    async def go() -> None:
        reader, writer = await _open(gw)
        first, second = _body("one"), _body("yes")
        writer.write(
            _head("/v1/completions", first)
            + first
            + _head("/v1/completions", second, extra="expect: 100-continue\r\n")
        )
        status, _, data = await _response(reader)  # never a 100 in the middle of this one
        assert status == 200 and b"one" in data
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(second)
        status, _, data = await _response(reader)
        assert status == 200 and b"yes" in data

    asyncio.run(go())
    assert_nothing_held(gw, ADMIN_HEADERS)


def test_body_over_the_limit_is_413_declared_or_streamed(gw: str) -> None:
    async def go() -> None:
        big = _body("x" * MAX_BODY)
        reader, writer = await _open(gw)  # declared: refused before any body byte is read
        writer.write(_head("/v1/completions", big))
        status, headers, data = await _response(reader)
        assert status == 413 and b'"code":413' in data and headers["connection"] == "close"
        assert await _closed(reader)
        reader, writer = await _open(gw)  # chunked: refused once it passes the limit
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
            + KEY.encode()
            + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(3):
            writer.write(b"%x\r\n%b\r\n" % (2048, b"x" * 2048))
        status, _, data = await _response(reader)
        assert status == 413
        assert await _closed(reader)

    asyncio.run(go())
    assert_nothing_held(gw, ADMIN_HEADERS)


def test_body_that_stops_arriving_is_408(gw: str) -> None:
    async def go() -> None:
        reader, writer = await _open(gw)
        body = _body()
        writer.write(_head("/v1/completions", body) + body[:5])
        status, _, data = await _response(reader)  # body_timeout_s is 2 s
        assert status == 408 and b"did not arrive in time" in data
        assert await _closed(reader)

    asyncio.run(go())
    assert_nothing_held(gw, ADMIN_HEADERS)


def test_refused_heads_with_and_without_their_body(gw: str) -> None:
    async def go() -> None:
        body = _body()
        reader, writer = await _open(gw)  # no key, whole body: 401, connection kept
        writer.write(_head("/v1/completions", body, key=None) + body)
        status, headers, data = await _response(reader)
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        writer.write(_head("/v1/completions", body) + body)
        assert (await _response(reader))[0] == 200
        reader, writer = await _open(gw)  # no key, body still to come: 401 now, then close
        writer.write(_head("/v1/completions", body, key=None))
        assert (await _response(reader))[0] == 401
        assert await _closed(reader)
        reader, writer = await _open(gw)  # GET on a POST route
        writer.write(f"GET /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}"
                     "\r\n\r\n".encode())  # fmt: skip
        status, _, data = await _response(reader)
        assert status == 405 and b'"code":405' in data

    asyncio.run(go())
    assert_nothing_held(gw, ADMIN_HEADERS)


def test_expect_100_continue_then_the_answer(gw: str) -> None:
    async def go() -> None:
        reader, writer = await _open(gw)
        body = _body("yes")
        writer.write(_head("/v1/completions", body, extra="expect: 100-continue\r\n"))
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        status, _, data = await _response(reader)
        assert status == 200 and b"yes" in data

    asyncio.run(go())
    assert_nothing_held(gw, ADMIN_HEADERS)


def test_streams_are_chunked_and_a_query_string_goes_through_asgi(gw: str) -> None:
    async def go() -> None:
        reader, writer = await _open(gw)
        body = _body("streamed", stream=True)
        writer.write(_head("/v1/completions", body) + body)
        status, headers, data = await _response(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert headers["content-type"].startswith("text/event-stream")
        assert data.rstrip().endswith(b"data: [DONE]")
        writer.write(_head("/v1/completions?x=1", _body("asgi")) + _body("asgi"))
        status, _, data = await _response(reader)
        assert status == 200 and b"asgi" in data

    asyncio.run(go())
    client = openai.OpenAI(base_url=gw + "/v1", api_key=KEY, max_retries=0)
    chunks = client.completions.create(model=MODEL, prompt="sdk", max_tokens=2, stream=True)
    assert any(c.choices and c.choices[0].text for c in chunks)
    assert httpx.get(gw + "/health").status_code == 200
    assert_nothing_held(gw, ADMIN_HEADERS)


class _Transport:
    """What a lane writes to, recorded."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _lane(transport: _Transport) -> Any:
    from uvicorn.protocols.http.flow_control import FlowControl

    from gpupool.gateway.api.lane import Lane

    t: Any = transport
    return Lane(t, FlowControl(t), "/v1/completions", [], True, [], lambda: None)


def test_a_reply_header_with_a_line_break_is_never_written_and_a_failure_is_a_500() -> None:
    from gpupool.gateway.api.lane import HeaderSplit
    from gpupool.gateway.reply import Reply

    transport = _Transport()
    lane = _lane(transport)
    evil = Reply(200, [("x-evil", "a\r\nset-cookie: x=1")], b"no")
    with pytest.raises(HeaderSplit):
        asyncio.run(lane.write(evil, []))
    assert transport.data == b"" and not lane.response_started
    lane.failed(HeaderSplit("a reply header contains a line break"))
    assert transport.data.startswith(b"HTTP/1.1 500 ") and b'"code":500' in transport.data
    assert b"connection: close\r\n" in transport.data and transport.closed
    assert b"set-cookie" not in transport.data


def test_a_failure_after_the_head_went_out_cuts_the_connection() -> None:
    from gpupool.gateway.reply import Reply

    async def stream() -> Any:
        yield b"data: 1\n\n"
        raise RuntimeError("boom")

    transport = _Transport()
    lane = _lane(transport)
    with pytest.raises(RuntimeError):
        asyncio.run(lane.write(Reply(200, [("content-type", "text/event-stream")],
                                     stream=stream()), []))  # fmt: skip
    assert transport.data.endswith(b"9\r\ndata: 1\n\n\r\n")  # the head and one chunk
    lane.failed(RuntimeError("boom"))
    assert transport.closed and b" 500 " not in transport.data
