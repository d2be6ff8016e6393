"""The long-window reserve end to end: `gpupool serve` in front of a long- and a short-window
simulated worker, the `openai` client, and the worker each answer names (``x-gpupool-worker``).

With one request running on the short worker, a short request ranks the idle long worker first
(a load band less busy). After a prompt that only the long window holds, it goes to the short
worker, which still has free slots; with the reserve off it goes to the long one. (No request
completes on the short worker first: the simulator answers in the same time whatever the prompt,
so its pace would mark the short worker slow against the long one's long prompt.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.procs import gateway, running, sim

MODEL = "m"


def _stack(tmp: Path, reserve_s: float) -> tuple[Any, ...]:
    long_w = sim(model=MODEL, max_model_len=8192, tmp=tmp, max_num_seqs=4, mode="echo")
    short_w = sim(model=MODEL, max_model_len=2048, tmp=tmp, max_num_seqs=4, mode="echo")
    cfg = {
        "server": {"host": "127.0.0.1", "expose_worker_header": True},
        "models": [{"name": MODEL}],
        "workers": [
            {"name": "long", "model": MODEL, "url": long_w.url, "max_inflight": 4},
            {"name": "short", "model": MODEL, "url": short_w.url, "max_inflight": 4},
        ],
        "routing": {"window_reserve_s": reserve_s, "metrics_interval_s": 3600},
    }
    return long_w, short_w, gateway(cfg, tmp)


@pytest.fixture(params=[60.0, 0.0], ids=["reserve", "off"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    long_w, short_w, gw = _stack(tmp_path, request.param)
    with running(long_w, short_w), running(gw, ready_path="/ready"):
        yield {"gw": gw, "reserve": request.param > 0}


def _worker(client: openai.OpenAI, words: int) -> str:
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": " ".join(["w"] * words)}], max_tokens=2
    )
    return r.headers["x-gpupool-worker"]


def test_a_long_prompt_keeps_the_long_worker_for_long_prompts(stack: dict[str, Any]) -> None:
    url = stack["gw"].url
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    hold = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}], "stream": True}
    held = threading.Thread(  # on an idle pool the smallest window takes it, for 5 s
        target=lambda: httpx.post(
            url + "/v1/chat/completions", json=hold, headers={"x-sim-hold-ms": "5000"}, timeout=30
        )
    )
    held.start()
    deadline = time.monotonic() + 10
    while _inflight(url)["short"] != 1:
        assert time.monotonic() < deadline, f"the hold never reached short: {_inflight(url)}"
        time.sleep(0.01)
    try:
        assert _worker(client, 3000) == "long"  # only the long window holds it
        # `short` is a band busier than the idle `long`; the reserve keeps `long` for long prompts
        assert _worker(client, 5) == ("short" if stack["reserve"] else "long")
    finally:
        held.join(30)
    assert _inflight(url) == {"long": 0, "short": 0}


def _inflight(url: str) -> dict[str, int]:
    return {w["name"]: w["inflight"] for w in httpx.get(url + "/admin/workers").json()["data"]}
