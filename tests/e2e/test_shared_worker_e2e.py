"""A shared worker stays light, end to end: `gpupool serve` in front of one simulated worker of
four slots, two tenants by key, plain HTTP.

`batch` holds three slots (the fourth is the reserved seat: `chat` was active) and has more
waiting; `chat` then runs in the seat for 2 s. Once chat's request runs, one of batch's leaves
(its client hangs up). With `queue.shared_share` 0.5 batch, holding half the worker beside
chat's request, takes no more there: its next request starts only after chat's ended. With 1.0
it refills at once. Every slot is back afterwards. Each step waits for the gateway to show the
one before (in flight, queued), so a loaded machine only makes it slower; with 1.0, `next` must
start within chat's 2 s after batch's hang-up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.hostile_tools import assert_nothing_held, held
from tests.support.procs import gateway, running, sim

MODEL = "m"
pytestmark = pytest.mark.timing


@pytest.fixture(params=[0.5, 1.0], ids=["shared", "off"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, mode="echo")
    cfg = {
        "server": {"host": "127.0.0.1"},
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": w.url, "max_inflight": 4}],
        "queue": {"reserved_slots": 1, "shared_share": request.param},
        "routing": {"metrics_interval_s": 3600},
    }
    gw = gateway(cfg, tmp_path)
    with running(w), running(gw, ready_path="/ready"):
        yield {"url": gw.url, "shared": request.param < 1}


def test_a_batch_does_not_refill_the_worker_an_interactive_request_runs_on(
    stack: dict[str, Any],
) -> None:
    url = stack["url"] + "/v1/chat/completions"
    done: dict[str, float] = {}

    async def send(client: httpx.AsyncClient, name: str, key: str, hold_ms: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": name}], "max_tokens": 1}
        h = {"authorization": f"Bearer {key}", "x-sim-hold-ms": str(hold_ms)}
        r = await client.post(url, json=body, headers=h)
        assert r.status_code == 200, r.text
        done[name] = time.monotonic()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await send(client, "hello", "chat-team", 0)  # chat is active: a seat is kept
            batch = [asyncio.create_task(send(client, f"b{i}", "batch-team", 60_000))
                     for i in range(3)]  # fmt: skip
            await _until(stack["url"], 3)
            after = [asyncio.create_task(send(client, "next", "batch-team", 0))]
            await _until_queued(stack["url"], 1)
            after.append(asyncio.create_task(send(client, "chat", "chat-team", 2000)))
            await _until(stack["url"], 4)  # chat's request runs in the seat
            batch[0].cancel()  # b0's client leaves: its slot is free
            await asyncio.gather(*after)
            for task in batch[1:]:
                task.cancel()
            await asyncio.gather(*batch, return_exceptions=True)

    asyncio.run(scenario())
    assert "b0" not in done
    if stack["shared"]:
        assert done["next"] > done["chat"]  # no new prefill beside chat's request
    else:
        assert done["next"] < done["chat"]  # refilled as soon as b0 ended
    assert_nothing_held(stack["url"])


async def _until(base: str, inflight: int) -> None:
    deadline = time.monotonic() + 10
    while _inflight(base) != inflight:
        assert time.monotonic() < deadline, f"in flight: {_inflight(base)}"
        await asyncio.sleep(0.01)


async def _until_queued(base: str, depth: int) -> None:
    deadline = time.monotonic() + 10
    while sum(held(base)["queued"].values()) != depth:
        assert time.monotonic() < deadline, f"queued: {held(base)['queued']}"
        await asyncio.sleep(0.01)


def _inflight(base: str) -> int:
    return int(httpx.get(base + "/admin/workers").json()["data"][0]["inflight"])
