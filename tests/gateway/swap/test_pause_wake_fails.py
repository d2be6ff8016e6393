"""A swap group's wake that fails and the requests its switch paused (issue 36).

Two simulated workers share one simulated GPU in a swap group: ``a`` (coder, awake) and ``b``
(chat, asleep). A coder stream runs on ``a``; a chat request makes the group switch, which
pauses the stream (``/sleep?mode=keep``) after ``swap.pause_after_s``, and at coder's next turn
``a``'s wake answers 500 (once). Then:

- with ``c``, another coder worker outside the group, ready: the failed wake cuts the paused
  stream (cause ``wake_failed``) and it goes on on ``c`` at once (every token once, one
  ``[DONE]``, the text ``c`` gives undisturbed), not after its idle deadline;
- ``a`` a ``url:`` member and no other coder worker: the stream is kept for the group's next
  wake, which resumes it (every token once, no error);
- ``a`` launched and no other coder worker: its restart would end the stream; it ends at once
  with the stream's error event (counted ``failed``), not after its idle deadline.

Nothing is held afterwards in any.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.swap.tools import launched, metric, serving, wait_states
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, running, sim

pytestmark = pytest.mark.timing  # a switch pauses the holder after swap.pause_after_s

TOKENS = 120
IDLE_S = 60.0  # the stream's idle deadline: far past the test's wait for its end
ENDS_WITHIN_S = 30.0


@contextmanager
def group(tmp: Path, other: bool) -> Iterator[tuple[Proc, str, Proc | None]]:
    """The gateway, ``a``'s url (coder, awake: it holds the GPU), and ``c`` (coder, outside the
    group: a larger window, so an idle ``a`` ranks first) when ``other``."""
    opts: dict[str, Any] = {"tmp": tmp, "enable_sleep_mode": True, "itl_ms": 50,
                            "output_tokens": TOKENS,
                            "gpu_memory_utilization": 0.85,
                            "sleep_ledger": str(tmp / "gpu0-ledger.json")}  # fmt: skip
    a, b = sim(model="coder", **opts), sim(model="chat", **opts)
    c = None
    if other:
        c = sim(model="coder", tmp=tmp, itl_ms=5, max_model_len=8192, output_tokens=TOKENS)
    cfg = _config([
        {"name": "a", "model": "coder", "url": a.url, "swap_group": "shared"},
        {"name": "b", "model": "chat", "url": b.url, "swap_group": "shared"},
        *([{"name": "c", "model": "coder", "url": c.url}] if c else []),
    ])  # fmt: skip
    extra = [c] if c else []
    with running(b, *extra):
        httpx.post(b.url + "/sleep?level=1", timeout=10).raise_for_status()  # a fits beside it
        with running(a), serving(cfg, tmp) as gw:
            wait_states(gw, {"a": "ready", "b": "asleep", **({"c": "ready"} if c else {})})
            yield gw, a.url, c


def _config(members: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": members,
        "routing": {"health_interval_s": 0.3, "health_timeout_s": 2, "metrics_interval_s": 3600,
                    "prefix_affinity": False},
        "server": {"upstream_read_timeout_s": IDLE_S, "expose_worker_header": True},
        # `turns`: the chat request gets the GPU once a held it min_awake_s, pausing the stream
        "swap": {"min_awake_s": 0.5, "pause_after_s": 0.3, "policy": "turns"},
        "queue": {"max_wait_s": 60},
    }  # fmt: skip


def _stream(url: str, first: Future[None]) -> tuple[str | None, list[str]]:
    """The worker header and every ``data:`` payload of a coder stream."""
    body = {"model": "coder", "prompt": "hi", "max_tokens": TOKENS, "stream": True}
    out: list[str] = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                if not first.done():
                    first.set_result(None)
        return r.headers.get("x-gpupool-worker"), out


def _text(events: list[str]) -> str:
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e).get("choices", []))


def _pause_then_fail_the_wake(gw: Proc, a: str) -> tuple[str | None, list[str], float]:
    """The coder stream, paused by a chat request's switch, then a's wake failing: what the
    client read, and the seconds from the failed wake to its stream's end."""
    httpx.post(a + "/sim/sleep", json={"wake_fail": "error"}).raise_for_status()
    with ThreadPoolExecutor(2) as pool:
        first: Future[None] = Future()
        streamed = pool.submit(_stream, gw.url, first)
        first.result(timeout=60)  # it runs on a
        chat = pool.submit(httpx.post, gw.url + "/v1/completions", timeout=60,
                           json={"model": "chat", "prompt": "hi", "max_tokens": 4})  # fmt: skip
        seen = wait_states(gw, {"a": "asleep"}, timeout=60)
        assert (seen["a"]["inflight"], seen["a"]["paused"]) == (1, 1)
        assert chat.result(timeout=60).status_code == 200
        wait_states(gw, {"a": "failed"}, timeout=60)  # coder's turn: a's wake answered 500
        failed_at = time.monotonic()
        worker, events = streamed.result(timeout=ENDS_WITHIN_S + 30)
        return worker, events, time.monotonic() - failed_at


def test_paused_stream_goes_on_on_another_worker_when_the_wake_fails(tmp_path: Path) -> None:
    with group(tmp_path, other=True) as (gw, a, c):
        assert c is not None
        worker, events, took = _pause_then_fail_the_wake(gw, a)
        assert_nothing_held(gw.url)
        moved = metric(gw, "gpupool_migrations_total", cause="wake_failed", outcome="continued")
        undisturbed = _stream(c.url, Future())[1]
        log = gw.log_path.read_text()
    assert worker == "a" and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in json.loads(e) for e in events[:-1]), events[-3:]
    assert _text(events) == _text(undisturbed)  # every token once: none lost, none twice
    assert took < ENDS_WITHIN_S  # it did not wait for its idle deadline
    assert moved == 1
    assert "worker a failed mid-answer (wake_failed); continued after" in log


def test_a_url_members_paused_stream_waits_for_the_next_wake_when_no_other_can_take_it(
    tmp_path: Path,
) -> None:
    with group(tmp_path, other=False) as (gw, a, _):
        _, events, _took = _pause_then_fail_the_wake(gw, a)
        assert_nothing_held(gw.url)
        moved = metric(gw, "gpupool_migrations_total")
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in json.loads(e) for e in events[:-1]), events[-3:]
    assert len(events) == TOKENS + 1  # one event a token: resumed where it was paused
    assert moved == 0


def test_a_launched_members_paused_stream_ends_at_once_when_no_other_can_take_it(
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "gpu0-ledger.json"
    cfg = _config([launched("a", "coder", ledger, **{"itl-ms": 50, "output-tokens": TOKENS}),
                   launched("b", "chat", ledger)])  # fmt: skip
    with serving(cfg, tmp_path) as gw:
        seen = wait_states(gw, {"a": "ready", "b": "asleep"})
        _, events, took = _pause_then_fail_the_wake(gw, seen["a"]["url"])
        assert_nothing_held(gw.url, within_s=30)
        failed = metric(gw, "gpupool_migrations_total", cause="wake_failed", outcome="failed")
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "error" in json.loads(events[-2]), events[-3:]  # vLLM's in-stream error event
    assert took < ENDS_WITHIN_S  # not after its idle deadline
    assert failed == 1
