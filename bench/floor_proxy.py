"""The floor of a Python proxy: uvloop and httptools on both sides, nothing else.

    .venv/bin/python bench/floor_proxy.py --port 9200 --upstream 127.0.0.1:9100

What any CPython gateway on asyncio must do per request and nothing more: parse the request
head and body (httptools), write it to a kept-alive upstream connection in one write, parse the
response (httptools), write it back in one write. One upstream connection per client connection,
no tasks, no coroutines, no futures: callbacks only. No auth, routing, limits, metrics or
timeouts, and it trusts every byte (no limits at all): not a product, a measuring stick.
``bench/wrkbench.py`` measures it beside gpupool and the Rust routers (target ``python-floor``):
whatever gpupool spends above it is the cost of its features, what the floor spends above
vllm-router is the cost of CPython.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import cast

import httptools
import uvloop

_STATUS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


class _Up(asyncio.Protocol):
    """The upstream connection of one client connection; answers go straight back."""

    def __init__(self, down: _Down) -> None:
        self.down = down
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.headers: list[bytes] = []
        self.body: list[bytes] = []
        self.pending: list[bytes] = []  # requests written before the connection was made
        self.waiter: asyncio.Future[bytes] | None = None  # --task: the request's task waits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's own class
        for data in self.pending:
            transport.write(data)
        self.pending.clear()

    def send(self, data: bytes) -> None:
        if self.transport is None:
            self.pending.append(data)
        else:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in (b"content-length", b"connection", b"transfer-encoding"):
            self.headers.append(b"%b: %b\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        body = b"".join(self.body)
        head = b"HTTP/1.1 %d %b\r\n%bcontent-length: %d\r\n\r\n" % (
            status, _STATUS.get(status, b"OK"), b"".join(self.headers), len(body),
        )  # fmt: skip
        self.headers.clear()
        self.body.clear()
        waiter, self.waiter = self.waiter, None
        if waiter is not None:
            waiter.set_result(head + body)
        else:
            self.down.reply(head + body)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class _Down(asyncio.Protocol):
    """One client connection."""

    def __init__(self, upstream: tuple[str, int], tasks: bool) -> None:
        self.upstream = upstream
        self.tasks = tasks
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.up: _Up | None = None
        self.connecting: asyncio.Task[object] | None = None
        self.task: asyncio.Task[None] | None = None
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's own class
        up = self.up = _Up(self)
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(loop.create_connection(lambda: up, *self.upstream))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.headers.append(b"content-type: %b\r\n" % value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        if self.url == b"/health":
            self.reply(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        else:
            assert self.up is not None
            body = b"".join(self.body)
            data = b"%b %b HTTP/1.1\r\nhost: upstream\r\n%bcontent-length: %d\r\n\r\n%b" % (
                method, self.url, b"".join(self.headers), len(body), body,
            )  # fmt: skip
            if self.tasks:
                self.task = asyncio.get_running_loop().create_task(self.exchange(data))
            else:
                self.up.send(data)
        self.url = b""
        self.headers.clear()
        self.body.clear()

    async def exchange(self, data: bytes) -> None:
        """--task: the request in a task of its own, awaiting its answer (as a gateway that
        may queue a request must do); what that structure costs over callbacks alone."""
        up = self.up
        assert up is not None
        up.waiter = asyncio.get_running_loop().create_future()
        up.send(data)
        self.reply(await up.waiter)

    def reply(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()


async def serve(port: int, upstream: tuple[str, int], tasks: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Down(upstream, tasks), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="host:port")
    p.add_argument("--task", action="store_true", help="Serve each request in a task.")
    args = p.parse_args()
    host, port = args.upstream.rsplit(":", 1)
    uvloop.run(serve(args.port, (host, int(port)), args.task))


if __name__ == "__main__":
    main()
