"""The poller of `url:` workers holds at most `routing.probe_concurrency` connections at once,
however many workers there are and however long each takes to answer (issue 35: 4,000
discovered addresses probed at once took every descriptor of the gateway)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gpupool.config.models import RoutingConfig
from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.remote import RemotePoller


class Slow:
    """A worker that answers only when told: counts the requests it holds at once."""

    def __init__(self) -> None:
        self.now = self.peak = self.served = 0
        self.go = asyncio.Event()
        self.full = asyncio.Event()
        self.limit = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.now += 1
        self.peak = max(self.peak, self.now)
        if self.now >= self.limit:
            self.full.set()
        try:
            await self.go.wait()
        finally:
            self.now -= 1
        self.served += 1
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})
        return web.Response(text="vllm:num_requests_running 0\n")


async def test_probes_and_scrapes_of_many_workers_hold_a_bounded_number_of_connections() -> None:
    slow = Slow()
    slow.limit = 5
    app = web.Application()
    for path in ("/health", "/v1/models", "/metrics/", "/metrics"):
        app.router.add_get(path, slow.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = site.name
    registry = Registry()
    for i in range(60):
        registry.add(Worker(name=f"w{i}", model="m", url=url, capacity=1))
    async with aiohttp.ClientSession() as session:
        poller = RemotePoller(registry, session, RoutingConfig(probe_concurrency=5))
        checks = asyncio.create_task(poller.check_all())
        for w in list(registry)[:3]:
            poller.check_soon(w)  # joined workers' first checks share the same slots
        await asyncio.wait_for(slow.full.wait(), 30)
        for _ in range(20):  # let every waiting probe try to start
            await asyncio.sleep(0)
        assert slow.now == 5
        slow.go.set()
        await asyncio.wait_for(checks, 60)
        assert all(w.state is WorkerState.ready for w in registry)
        await asyncio.wait_for(poller.scrape_all(), 60)
        assert slow.peak == 5
        await poller.close()
    await runner.cleanup()
