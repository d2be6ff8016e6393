"""Thousands of workers that accept a connection and never answer: ``python tarpit.py PORT N``
listens on 127.1.x.y:PORT for N addresses (loopback, no setup needed), prints ``ready``, and
holds every connection until its client gives up. What a pool of hung or firewalled hosts looks
like to the gateway's probes: each one holds a descriptor until its timeout."""

from __future__ import annotations

import asyncio
import resource
import sys


def address(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


async def main(port: int, n: int) -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                pass
        except OSError:
            pass
        writer.close()

    servers = [await asyncio.start_server(hold, address(i), port) for i in range(n)]
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for s in servers:
            s.close()


if __name__ == "__main__":
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
