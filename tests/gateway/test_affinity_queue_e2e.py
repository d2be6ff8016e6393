"""A queued conversation is first in line for its own worker, end to end, and no slot stays
empty: `gpupool serve` in front of two simulated workers of one slot each, the `openai` client,
and the worker each answer names (``x-gpupool-worker``).

The conversation's first turn lands on `home`. Then `other` is held for 4 s and `home` for
6 s by two unrelated streams; the second turn queues, and a plain request queues after it.
`other` frees first: with `routing.affinity_wait_s` the plain request takes it (the second
turn stays first in line for `home`, whose cache holds its history); with 0, queue order: the
second turn takes it. Either way the one left takes the next slot that frees: no slot stays
empty while a request waits. Every slot is back afterwards.
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
SYSTEM = {"role": "system", "content": " ".join(["w"] * 1500)}  # a history worth keeping


@pytest.fixture(params=[5.0, 0.0], ids=["wait", "off"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    a = sim(model=MODEL, max_model_len=32768, tmp=tmp_path, max_num_seqs=1, mode="echo")
    b = sim(model=MODEL, max_model_len=32768, tmp=tmp_path, max_num_seqs=1, mode="echo")
    cfg = {
        "server": {"host": "127.0.0.1", "expose_worker_header": True},
        "models": [{"name": MODEL}],
        "workers": [
            {"name": "a", "model": MODEL, "url": a.url, "max_inflight": 1},
            {"name": "b", "model": MODEL, "url": b.url, "max_inflight": 1},
        ],
        "routing": {"affinity_wait_s": request.param, "metrics_interval_s": 3600},
    }
    gw = gateway(cfg, tmp_path)
    with running(a, b), running(gw, ready_path="/ready"):
        yield {"url": gw.url, "waits": request.param > 0, "sims": {"a": a.url, "b": b.url}}


def _turn(client: openai.OpenAI, *later: dict[str, str]) -> str:
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "hello"}, *later]
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2
    )
    return r.headers["x-gpupool-worker"]


def _hold(url: str, ms: int, on: str) -> threading.Thread:
    """A stream of its own prompt that holds a worker's one slot for ``ms``; returns once it
    is running on ``on`` (the only free worker then)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hold {on}"}], "stream": True}
    t = threading.Thread(
        target=lambda: httpx.post(
            url + "/v1/chat/completions", json=body, headers={"x-sim-hold-ms": str(ms)}, timeout=30
        )
    )
    t.start()
    deadline = time.monotonic() + 10
    while _inflight(url)[on] != 1:
        assert time.monotonic() < deadline, f"the hold never reached {on}: {_inflight(url)}"
        time.sleep(0.01)
    return t


def test_a_queued_conversation_is_first_in_line_for_its_worker_and_no_slot_stays_empty(
    stack: dict[str, Any],
) -> None:
    url = stack["url"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    home = _turn(client)
    other = "b" if home == "a" else "a"
    holds = [_hold(url, 4000, other), _hold(url, 6000, home)]  # `other` frees first
    try:
        got: dict[str, str] = {}
        turn = threading.Thread(target=lambda: got.update(second=_turn(
            client, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}
        )))  # fmt: skip
        turn.start()
        _until_queued(url, 1)
        plain = threading.Thread(target=lambda: got.update(plain=_plain(client)))
        plain.start()
        _until_queued(url, 2)
        turn.join(30)
        plain.join(30)
        # `other` frees first and goes to the plain request when the second turn waits in
        # line for `home`, to the second turn when it does not; whichever is left takes the
        # next slot that frees (no slot stays empty while either waits)
        # which of the two started first on `other` (its own record: the replies' arrival
        # order is the threads' business)
        prompts = httpx.get(stack["sims"][other] + "/sim/stats").json()["prompts"]
        started = [p for p in prompts if "hold" not in p]
        served_first = "second" if "w w w" in started[0] else "plain"
        assert served_first == ("plain" if stack["waits"] else "second"), started
        assert got[served_first] == other
    finally:
        for t in holds:
            t.join(30)
    assert _inflight(url) == {"a": 0, "b": 0}


def _plain(client: openai.OpenAI) -> str:
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "unrelated"}], max_tokens=2
    )
    return r.headers["x-gpupool-worker"]


def _until_queued(url: str, n: int) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(url + "/admin/queue").json()["models"].get(MODEL, {}).get("depth") != n:
        assert time.monotonic() < deadline, "the request never queued"
        time.sleep(0.01)


def _inflight(url: str) -> dict[str, int]:
    return {w["name"]: w["inflight"] for w in httpx.get(url + "/admin/workers").json()["data"]}
