"""One long prefill at a time, end to end: `gpupool serve` in front of a simulated worker whose
first token comes ``x-sim-hold-ms`` after a request arrives (its prefill), driven by the `openai`
client.

No assertion can fail on a slow machine: a long stream that waited for the one before it cannot
show its first token sooner than that one's first token plus its own prefill (a lower bound), and
a short stream that did not wait shows its first token before a long one that started earlier
and prefills for seconds (an order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.procs import gateway, running, sim

MODEL = "m"
PREFILL_S = 0.8
LONG = " ".join(["word"] * 400)  # over the gate's 200 tokens at any bytes per token


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("gate")
    worker = sim(model=MODEL, max_model_len=8192, tmp=tmp, max_num_seqs=4, mode="echo")
    cfg = {
        "server": {"host": "127.0.0.1"},
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": worker.url}],
        "routing": {"prefill_gate_tokens": 200, "metrics_interval_s": 3600},
    }
    gw = gateway(cfg, tmp)
    with running(worker), running(gw, ready_path="/ready"):
        yield {"gw": gw}


def _first_token_at(
    url: str, prompt: str, prefill_s: float, out: dict[str, float], key: str
) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        stream=True,
        extra_headers={"x-sim-hold-ms": str(int(prefill_s * 1000))},
    )
    for _ in stream:
        out.setdefault(key, time.monotonic())
    out[key + "_end"] = time.monotonic()


def _two(url: str, first: tuple[str, float], second: tuple[str, float]) -> dict[str, float]:
    """Two streams, the second once the first is on the worker: (prompt, prefill seconds) each."""
    out: dict[str, float] = {}
    a = threading.Thread(target=_first_token_at, args=(url, *first, out, "a"))
    b = threading.Thread(target=_first_token_at, args=(url, *second, out, "b"))
    a.start()
    # an order, not a head start: after 0.1 s a loaded machine could still send `b` first
    deadline = time.monotonic() + 30
    while _inflight(url) < 1:
        assert time.monotonic() < deadline, "the first stream never reached the worker"
        time.sleep(0.01)
    b.start()
    a.join(30)
    b.join(30)
    assert {"a_end", "b_end"} <= set(out)
    return out


def _inflight(url: str) -> int:
    return sum(w["inflight"] for w in httpx.get(url + "/admin/workers").json()["data"])


def _idle(url: str) -> None:
    assert _inflight(url) == 0


def test_a_long_stream_starts_after_the_long_one_before_it_prefilled(
    stack: dict[str, Any],
) -> None:
    url = stack["gw"].url
    t = _two(url, (LONG, PREFILL_S), (LONG + " more", PREFILL_S))
    assert t["b"] - t["a"] >= PREFILL_S * 0.75  # sent once `a` was on; prefilled after `a`'s
    _idle(url)


def test_a_short_stream_is_not_held_behind_a_long_prefill(stack: dict[str, Any]) -> None:
    url = stack["gw"].url
    t = _two(url, (LONG, 5.0), ("hello", PREFILL_S))
    assert t["b"] < t["a"]  # sent once `a` was on, prefilled beside `a`, not after it
    _idle(url)
