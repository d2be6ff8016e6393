"""The canary reads its worker's whole answer, however the body arrives."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from gpupool.workers.swap import canary


async def _split_server(body: bytes, task_done: asyncio.Event) -> tuple[asyncio.Server, int]:
    """An HTTP/1.1 server that sends half of ``body``, waits for the client to be done with it
    or a while, then sends the rest."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body[: len(body) // 2]
        )
        await writer.drain()
        for _ in range(20):  # a read of the first half alone ends the client's ask meanwhile
            if task_done.is_set():
                break
            await asyncio.sleep(0.01)
        writer.write(body[len(body) // 2 :])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_canary_answer_in_two_packets_is_read_whole() -> None:
    body = orjson.dumps({"choices": [{"index": 0, "text": " 5, 7, 11"}]})

    async def go() -> str:
        done = asyncio.Event()
        server, port = await _split_server(body, done)
        async with server, aiohttp.ClientSession() as session:
            try:
                return await canary.ask(session, f"http://127.0.0.1:{port}", "m", 10.0)
            finally:
                done.set()

    assert asyncio.run(go()) == " 5, 7, 11"
