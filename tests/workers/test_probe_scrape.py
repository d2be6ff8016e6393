"""The load scrape asks for the few gauges routing reads, and falls back to the whole
``/metrics`` for a server that refuses the filtered path (remembered per worker)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gpupool.workers.probe import scrape_load

GAUGES = (
    'vllm:num_requests_running{engine="0"} 2.0\n'
    'vllm:num_requests_waiting{engine="0"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
)


async def _server(filtered: bool, seen: list[str]) -> web.AppRunner:
    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        return web.Response(text="# other families\n" + GAUGES)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if filtered:
        app.router.add_get("/metrics/", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _url(runner: web.AppRunner) -> str:
    site = next(iter(runner.sites))
    assert isinstance(site, web.TCPSite)
    return site.name


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize("filtered", [True, False])
async def test_scrape_asks_for_the_gauges_and_falls_back_once(
    session: aiohttp.ClientSession, filtered: bool
) -> None:
    seen: list[str] = []
    runner = await _server(filtered, seen)
    try:
        url, plain = _url(runner), set[str]()
        for _ in range(2):
            load = await scrape_load(session, url, unfiltered=plain)
            assert load is not None
            assert (load.running, load.waiting, load.kv_usage) == (2.0, 1.0, 0.5)
    finally:
        await runner.cleanup()
    if filtered:
        assert plain == set()
        assert all(p.startswith("/metrics/?name") for p in seen) and len(seen) == 2
    else:  # refused once, then asked in full without trying again
        assert plain == {url}
        assert seen == ["/metrics", "/metrics"]


async def test_an_unreachable_worker_is_not_taken_for_one_without_the_filter(
    session: aiohttp.ClientSession,
) -> None:
    plain: set[str] = set()
    assert await scrape_load(session, "http://127.0.0.1:9", 0.5, plain) is None
    assert plain == set()


@pytest.mark.parametrize("block_size", ["²", "0", "-16", "16.0", ""])
def test_a_cache_info_line_with_a_block_size_not_a_positive_number_reads_as_unknown(
    block_size: str,
) -> None:
    """A worker is only semi-trusted: a block size such as ``²`` (a digit to ``isdigit``, not
    to ``int``) once raised out of the scrape and ended the poller's scrape loop for every
    worker; ``0`` made every precisely routed request fail on a zero block step."""
    from gpupool.workers.probe import parse_load

    line = (
        f'vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True",'
        f'num_gpu_blocks="{block_size}",prefix_caching_hash_algo="sha256"}} 1.0\n'
    )
    load = parse_load(line + GAUGES)
    assert load.cache is not None
    assert load.cache.block_size is None and load.cache.num_blocks is None
    assert load.running == 2.0
