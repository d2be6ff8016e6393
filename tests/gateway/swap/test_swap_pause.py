"""A switch pauses the awake model's running requests after ``swap.pause_after_s`` (vLLM's
``/sleep?mode=keep``), serves the other model, and resumes them at the next wake: the client
of a paused request loses nothing (one stream, every token, then ``[DONE]``; a whole answer
with every token), however long its stream stalled. With ``pause_after_s: null`` a switch waits
for the running requests as before.

Each test checks the invariants after the fact: the sims' ledger (no start or wake while the
other held the GPU, no request reached a sleeping worker, no sleep aborted a generation; the
paused worker's sleeps that kept generations), nothing held by the gateway once the clients are
done, and, while it ran, never two members of the group awake (``Sampler``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RedisServer
from tests.gateway.swap.tools import (
    Sampler,
    launched,
    ledger_of,
    metric,
    serving,
    two_model_config,
    wait_states,
    workers,
)
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc

pytestmark = pytest.mark.timing  # a switch pauses the holder after swap.pause_after_s

DEADLINE_S = 120.0
TOKENS = 200


def _config(tmp: Path, backend: str, redis: RedisServer, pause: float | None) -> dict[str, Any]:
    queue: dict[str, Any] = {"backend": backend, "max_wait_s": DEADLINE_S}
    if backend == "redis":
        queue |= {"redis_url": redis.url, "redis_prefix": f"pause-{tmp.name}"}
    # a short idle deadline: a paused stream outlives it (held while paused, not cut); 2 s,
    # forty times the gap between tokens, so a loaded machine's stall cannot cut a stream
    # the `turns` policy switches for one waiting request once `min_awake_s` passed (`weighed`
    # would wait for the running request to end: nothing would be paused)
    cfg = two_model_config(tmp, queue=queue, swap={"pause_after_s": pause, "policy": "turns"},
                           server={"upstream_read_timeout_s": 2.0})  # fmt: skip
    ledger = tmp / "gpu0-ledger.json"
    # coder: 200 tokens at 50 ms (10 s a request); chat wakes slowly (4 s: the pause outlasts
    # the idle deadline twice), so the paused worker is seen asleep with its request kept
    cfg["workers"] = [launched("coder-w", "coder", ledger, **{"itl-ms": 50}),
                      launched("chat-w", "chat", ledger, **{"wake-s": 4.0})]  # fmt: skip
    return cfg


def _stream(gw: Proc, model: str, first: Future[None]) -> list[str]:
    """A raw SSE stream: every ``data:`` payload, ``[DONE]`` included."""
    body = {"model": model, "prompt": "hi", "max_tokens": TOKENS, "stream": True}
    out: list[str] = []
    with (
        httpx.Client(timeout=DEADLINE_S) as client,
        client.stream("POST", gw.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if not first.done():
                    first.set_result(None)
    return out


def _whole(gw: Proc, model: str, tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": "hi", "max_tokens": tokens}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _running_on(gw: Proc, name: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while workers(gw)[name]["inflight"] != 1:
        assert time.monotonic() < deadline, f"nothing ever ran on {name}"
        time.sleep(0.02)


def _paused_while_chat_wakes(gw: Proc) -> None:
    seen = wait_states(gw, {"coder-w": "asleep", "chat-w": "waking"}, timeout=DEADLINE_S)
    assert (seen["coder-w"]["inflight"], seen["coder-w"]["paused"]) == (1, 1)


def _clean(gw: Proc, tmp: Path, sampler: Sampler) -> dict[str, Any]:
    assert_nothing_held(gw.url, within_s=DEADLINE_S)
    assert workers(gw)["coder-w"]["paused"] == 0
    assert sampler.samples > 10 and sampler.most_awake == 1
    ledger = ledger_of(tmp)
    assert ledger["violations"] == []
    assert ledger["peak_awake"] <= 1.0
    return ledger


def _kept(ledger: dict[str, Any]) -> int:
    return sum(m.get("sleeps_kept", 0) for m in ledger["members"].values())


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_paused_stream_resumes_with_every_token(
    tmp_path: Path, backend: str, redis_server: RedisServer
) -> None:
    with serving(_config(tmp_path, backend, redis_server, 0.5), tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        with Sampler(gw) as sampler, ThreadPoolExecutor(2) as pool:
            first: Future[None] = Future()
            streamed = pool.submit(_stream, gw, "coder", first)
            first.result(timeout=DEADLINE_S)  # it runs on coder-w
            other = pool.submit(_whole, gw, "chat", 4)
            _paused_while_chat_wakes(gw)
            assert other.result(timeout=DEADLINE_S)["choices"][0]["text"]
            events = streamed.result(timeout=DEADLINE_S)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == TOKENS  # one a token: none lost, none twice
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # not "abort"
        assert metric(gw, "gpupool_swap_paused_requests_total", group="gpu0", model="coder") >= 1
        ledger = _clean(gw, tmp_path, sampler)
    assert _kept(ledger) >= 1


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_paused_whole_answer_is_whole(
    tmp_path: Path, backend: str, redis_server: RedisServer
) -> None:
    with serving(_config(tmp_path, backend, redis_server, 0.5), tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        with Sampler(gw) as sampler, ThreadPoolExecutor(2) as pool:
            whole = pool.submit(_whole, gw, "coder", TOKENS)
            _running_on(gw, "coder-w")
            other = pool.submit(_whole, gw, "chat", 4)
            _paused_while_chat_wakes(gw)
            assert other.result(timeout=DEADLINE_S)["choices"][0]["text"]
            answer = whole.result(timeout=DEADLINE_S)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")  # not "abort"
        assert answer["usage"]["completion_tokens"] == TOKENS
        ledger = _clean(gw, tmp_path, sampler)
    assert _kept(ledger) >= 1


def test_without_pause_after_s_a_switch_waits_for_the_stream(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with serving(_config(tmp_path, "memory", redis_server, None), tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        with Sampler(gw) as sampler, ThreadPoolExecutor(2) as pool:
            first: Future[None] = Future()
            streamed = pool.submit(_stream, gw, "coder", first)
            first.result(timeout=DEADLINE_S)
            other = pool.submit(_whole, gw, "chat", 4)
            wait_states(gw, {"coder-w": "falling_asleep"}, timeout=DEADLINE_S)
            events = streamed.result(timeout=DEADLINE_S)
            assert other.result(timeout=DEADLINE_S)["choices"][0]["text"]
        assert events[-1] == "[DONE]" and len(events) == TOKENS + 1
        assert metric(gw, "gpupool_swap_paused_requests_total") == 0
        ledger = _clean(gw, tmp_path, sampler)
    assert _kept(ledger) == 0
