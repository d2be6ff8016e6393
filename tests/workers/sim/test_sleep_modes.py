"""``POST /sleep?level=N&mode=wait|abort|keep`` in the simulator behaves as vLLM's does.

``wait`` lets the generations in flight finish (a client that left ends its own at once), then
sleeps: counted in ``sleeps_waited``, not a violation. ``abort`` (also what no ``mode`` means)
ends them as vLLM's engine abort does (a stream's last chunk says ``finish_reason: "abort"``,
then usage and ``[DONE]``; a whole reply is a 200 with what was made), and is a violation: it
lost work. ``keep`` pauses them until the wake (no token while asleep), then they go on where they
were, whole: counted in ``sleeps_kept``, not a violation. A generation request while a sleep is
under way is refused as while asleep."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpupool.workers.sim.app import SimApp, create_sim_app
from gpupool.workers.sim.config import GpuShape, SimConfig
from gpupool.workers.sim.sleep import SleepSettings
from tests.support.procs import running, sim

DEADLINE_S = 30.0
ENGINES = {"classic": None, "gpu": GpuShape(step_ms=20.0)}


def _app(tmp: Path, engine: str = "classic", **config: Any) -> SimApp:
    settings = SleepSettings(sleep_s=0, wake_s=0, ledger=str(tmp / "ledger.json"))
    opts: dict[str, Any] = {"model": "m", "mode": "lorem", "output_tokens": 4000, "itl_ms": 20,
                            **config}  # fmt: skip
    return create_sim_app(SimConfig(gpu=ENGINES[engine], **opts), settings)


def _client(app: SimApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


async def _until(what: str, check: Callable[[], bool | Awaitable[bool]]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        seen = check()
        if seen if isinstance(seen, bool) else await seen:
            return
        assert time.monotonic() < deadline, f"never {what}"
        await asyncio.sleep(0.01)


def _events(body: str) -> list[Any]:
    data = [line[6:] for line in body.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _stream(client: httpx.AsyncClient, tokens: int) -> asyncio.Task[httpx.Response]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    return asyncio.ensure_future(client.post("/v1/chat/completions", json=body))


def _whole(client: httpx.AsyncClient, tokens: int) -> asyncio.Task[httpx.Response]:
    body = {"prompt": "hi", "max_tokens": tokens}
    return asyncio.ensure_future(client.post("/v1/completions", json=body))


async def test_wait_lets_a_running_stream_finish_then_sleeps(tmp_path: Path) -> None:
    app = _app(tmp_path)
    assert app.sleep is not None
    async with _client(app) as client:
        streamed = _stream(client, 30)
        await _until("the stream runs", lambda: app.sleep is not None and app.sleep.running() == 1)
        r = await client.post("/sleep?level=1&mode=wait")
        assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 1}
        assert app.sleep.running() == 0  # it answered once the stream had ended, whole:
        events = _events((await streamed).text)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 30  # whole
        stats = (await client.get("/sim/sleep")).json()
    assert (stats["asleep"], stats["sleeps"], stats["sleeps_waited"]) == (True, 1, 1)
    assert stats["violations"] == []
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["violations"] == []
    assert [m["sleeps_waited"] for m in ledger["members"].values()] == [1]


async def test_a_request_while_a_sleep_waits_is_refused_as_while_asleep(tmp_path: Path) -> None:
    app = _app(tmp_path)
    async with _client(app) as client:
        streamed = _stream(client, 30)
        await _until("the stream runs", lambda: app.sleep is not None and app.sleep.running() == 1)
        sleeping = asyncio.ensure_future(client.post("/sleep?level=1&mode=wait"))

        async def falling() -> bool:
            return bool((await client.get("/sim/sleep")).json()["falling_asleep"])

        await _until("falling asleep", falling)
        late = await _whole(client, 4)
        assert late.status_code == 503
        assert (await sleeping).status_code == 200
        assert (await streamed).status_code == 200
        stats = (await client.get("/sim/sleep")).json()
    assert stats["violations"] == ["/v1/completions while falling asleep"]


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("query", ["?level=1", "?level=1&mode=abort"])
async def test_abort_ends_what_runs_and_waits_as_vllm_does(
    tmp_path: Path, engine: str, query: str
) -> None:
    app = _app(tmp_path, engine, max_num_seqs=1)  # the second request waits for the slot
    async with _client(app) as client:
        streamed = _stream(client, 2000)  # 40 s of tokens: only the abort ends it
        await _until("the stream's first token", _first_token(client))
        whole = _whole(client, 2000)
        await _until("both in", lambda: app.sleep is not None and app.sleep.running() == 2)
        r = await client.post("/sleep" + query)  # no mode: vLLM's default, abort
        assert r.status_code == 200
        events = _events((await streamed).text)
        made = sum(bool(e["choices"] and e["choices"][0]["delta"].get("content")) for e in events)
        last = events[-2]["choices"][0]
        assert (last["delta"], last["finish_reason"]) == ({}, "abort")
        assert 0 < events[-1]["usage"]["completion_tokens"] == made < 2000
        answer = (await whole).json()
        assert answer["choices"][0]["finish_reason"] == "abort"
        assert answer["usage"]["completion_tokens"] == 0  # it never had the slot
        stats = (await client.get("/sim/stats")).json()
        assert (stats["running"], stats["aborted_total"]) == (0, 2)
        sleep = (await client.get("/sim/sleep")).json()
    assert sleep["asleep"] and sleep["sleeps_waited"] == 0
    assert sleep["violations"] == ["sleep (mode=abort) aborted 2 generation(s)"]


def _first_token(client: httpx.AsyncClient) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        text = (await client.get("/metrics")).text
        name = "vllm:time_to_first_token_seconds_count"
        return any(x.startswith(name) and not x.endswith(" 0.0") for x in text.splitlines())

    return check


async def test_an_aborted_whole_reply_keeps_what_was_made(tmp_path: Path) -> None:
    app = _app(tmp_path, ttft_ms=0)
    async with _client(app) as client:
        whole = _whole(client, 2000)
        await _until("it runs", lambda: app.sleep is not None and app.sleep.running() == 1)
        await asyncio.sleep(0.2)  # (some tokens due: not a timed assertion, only more to cut)
        assert (await client.post("/sleep?level=2&mode=abort")).status_code == 200
        answer = (await whole).json()
    choice, use = answer["choices"][0], answer["usage"]
    assert choice["finish_reason"] == "abort" and 0 < use["completion_tokens"] < 2000
    assert choice["text"]


@pytest.mark.parametrize(
    ("query", "status", "locs"),
    [("?level=x", 422, [["query", "level"]]), ("?level=3", 422, [["query", "level"]]),
     ("?level=-1&mode=later", 422, [["query", "level"], ["query", "mode"]])],
)  # fmt: skip
async def test_a_bad_sleep_query_is_refused_in_vllms_shape(
    tmp_path: Path, query: str, status: int, locs: list[list[str]]
) -> None:
    async with _client(_app(tmp_path)) as client:
        r = await client.post("/sleep" + query)
        assert r.status_code == status
        assert [d["loc"] for d in r.json()["detail"]] == locs
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}


def test_wait_ends_at_once_for_a_client_that_left(tmp_path: Path) -> None:
    """The gateway's race: its client left mid-stream and it asked for the sleep before the
    worker saw that client go. The sleep waits only for the abort, not the 100 s stream."""
    worker = sim(tmp=tmp_path, enable_sleep_mode=True, itl_ms=50, output_tokens=4000)
    with running(worker):
        host, port = worker.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "hi", "max_tokens": 2000, "stream": True})
        s = socket.create_connection((host, int(port)))
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                   f"\r\ncontent-length: {len(body)}\r\n\r\n{body}").encode())  # fmt: skip
        seen = b""
        while b"data: " not in seen:  # it runs
            seen += s.recv(65536)
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(
                httpx.post(worker.url + "/sleep?level=1&mode=wait", timeout=DEADLINE_S)
            )
        )
        thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while not httpx.get(worker.url + "/sim/sleep").json()["falling_asleep"]:
            assert time.monotonic() < deadline, "the sleep never came"
            time.sleep(0.02)
        s.close()  # the client leaves
        thread.join(DEADLINE_S)
        assert [a.status_code for a in answers] == [200]
        stats = httpx.get(worker.url + "/sim/sleep").json()
        assert (stats["asleep"], stats["sleeps_waited"], stats["violations"]) == (True, 1, [])
        assert httpx.get(worker.url + "/sim/stats").json()["aborted_total"] == 1


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("level", [1, 2])
async def test_keep_freezes_the_generations_until_the_wake(
    tmp_path: Path, engine: str, level: int
) -> None:
    app = _app(tmp_path, engine)
    assert app.sleep is not None
    async with _client(app) as client:
        streamed, whole = _stream(client, 40), _whole(client, 40)
        await _until("both run", lambda: app.sleep is not None and app.sleep.running() == 2)
        await asyncio.sleep(0.1)  # (some tokens made: not a timed assertion)
        r = await client.post(f"/sleep?level={level}&mode=keep")
        assert r.status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        made = app.service.engine.metrics.counters["generation_tokens"]
        await asyncio.sleep(0.3)  # frozen: nothing ends, nothing is made
        assert not streamed.done() and not whole.done() and app.sleep.running() == 2
        assert app.service.engine.metrics.counters["generation_tokens"] == made
        tags = ["?tags=weights", "?tags=kv_cache"] if level == 2 else [""]
        for tag in tags:
            assert (await client.post("/wake_up" + tag)).status_code == 200
        events = _events((await streamed).text)
        answer = (await whole).json()
        stats = (await client.get("/sim/sleep")).json()
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 40  # every token, after the wake
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 40
    assert (stats["sleeps_kept"], stats["sleeps_waited"], stats["violations"]) == (1, 0, [])
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["violations"] == []
    assert [m["sleeps_kept"] for m in ledger["members"].values()] == [1]
