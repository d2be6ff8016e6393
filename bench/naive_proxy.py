"""The simplest Python proxy worth comparing against: aiohttp server + one aiohttp client session.

    .venv/bin/python bench/naive_proxy.py --port 9200 --upstream http://127.0.0.1:9100

Every request is forwarded as it is (method, path, body, content-type) and the answer returned
whole. No auth, no routing, no limits, no metrics: the floor a Python gateway built on aiohttp
starts from. ``bench/wrkbench.py`` measures it beside gpupool (target ``aiohttp-naive``).
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import uvloop
from aiohttp import web


def make_app(upstream: str) -> web.Application:
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.Response:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as resp:
            data = await resp.read()
            return web.Response(body=data, status=resp.status, content_type=resp.content_type)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    args = p.parse_args()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(
        make_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
