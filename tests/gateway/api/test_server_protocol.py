"""gpupool's HTTP/1.1 server protocol (``gateway/api/protocol.py``) under a real uvicorn, on
loopback, read with raw sockets: what a client sees of keep-alive and of sized responses.

These also guard the parts of uvicorn 0.54 that the protocol replaces (``on_response_complete``
and the framing of a sized response): if uvicorn changes them, these fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from gpupool.gateway.api.protocol import guarded_protocol
from tests.support.procs import free_port

# 2 s, requests 0.5 s apart: a busy connection is closed only by a stall of 1.5 s (at 1 s and 0.3,
# a 0.7-s stall of this process lets the server's keep-alive timer run before the next request)
KEEP_ALIVE_S = 2.0


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/bad":  # a header value with a line break: never written
        headers = [(b"content-type", b"text/plain"), (b"x-evil", b"a\r\nset-cookie: x=1")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"no"})
        return
    body = b'{"ok":true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"11")]
    if scope["path"] == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def server() -> AsyncIterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(10.0, 64 * 1024),
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,  # type: ignore[arg-type]
    )
    srv = uvicorn.Server(config)
    task = asyncio.ensure_future(srv.serve())
    while not srv.started:  # noqa: ASYNC110 (uvicorn.Server exposes a flag, not an event)
        await asyncio.sleep(0.01)
    yield port
    srv.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    path: str = "/") -> bytes:  # fmt: skip
    writer.write(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{{}}".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-le")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_sized_response_is_framed_once_with_date_and_no_server(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    reply = await _exchange(reader, writer)
    head, body = reply.split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    names = [line.split(b":")[0] for line in lines[1:]]
    assert names == [b"date", b"content-type", b"content-length"]
    assert body == b'{"ok":true}'
    again = await _exchange(reader, writer)  # the same connection answers again
    assert again.split(b"\r\n\r\n")[1] == body
    writer.close()


async def test_connection_close_header_closes_after_the_response(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    reply = await _exchange(reader, writer, "/close")
    assert b"\r\nconnection: close\r\n" in reply
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_header_injection_is_refused_not_written(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"POST /bad HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    data = await asyncio.wait_for(reader.read(), 5)
    assert b"set-cookie" not in data  # uvicorn's check raised: a 500 or a dropped connection
    writer.close()


async def test_busy_keep_alive_connection_stays_and_an_idle_one_is_closed(server: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    # five requests 0.5 s apart span longer than the keep-alive timeout: never idle that long
    for _ in range(5):
        assert (await _exchange(reader, writer)).endswith(b'{"ok":true}')
        await asyncio.sleep(0.5)
    assert (await _exchange(reader, writer)).endswith(b'{"ok":true}')
    # then idle: closed by the keep-alive timeout (well before this test's 5 s limit)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_invalid_request_gets_400_and_a_closed_connection(server: int) -> None:
    """The protocol's own ``data_received`` (uvicorn's, written out): a parser error is a 400."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert data.endswith(b"Invalid HTTP request received.")
    writer.close()


async def test_headers_are_lowercased_and_expect_continue_is_answered(server: int) -> None:
    """``on_header`` (uvicorn's, written out): ``Expect: 100-continue`` in any case is heard."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"{}")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    writer.close()
