"""Waiting for a switch, visible: a streamed request for a sleeping model gets SSE comments that
name the model being woken; a 429 for it carries a Retry-After from the group's switch time;
/admin/workers shows each group's holder, waiting requests and switches; an admin action the
policy will undo says so in its result. Each test ends with the ledger clean and nothing held."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.swap.tools import (
    ledger_of,
    serving,
    two_model_config,
    wait_states,
    workers,
)
from tests.support.procs import Proc


def _groups(gw: Proc) -> dict[str, dict[str, Any]]:
    reply = httpx.get(f"{gw.url}/admin/workers", timeout=10).json()
    return {g["name"]: g for g in reply["groups"]}


def _clean(gw: Proc, tmp: Path) -> None:
    held = httpx.get(gw.url + "/admin/held", timeout=10).json()
    assert set(held["inflight"].values()) <= {0} and set(held["queued"].values()) <= {0}
    ledger = ledger_of(tmp)
    assert ledger["violations"] == [] and ledger["peak_awake"] <= 1.0


def _queued(gw: Proc, model: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _groups(gw)["gpu0"]["waiting"].get(model):
            return
        time.sleep(0.02)
    raise AssertionError(f"nothing waiting for {model}: {_groups(gw)}")


def test_a_stream_waiting_for_a_switch_hears_which_model_is_woken(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path)
    cfg["workers"][1]["launch"]["args"]["wake-s"] = 6.0  # past one keep-alive (5 s)
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        before = _groups(gw)["gpu0"]
        assert (before["holder"], before["switches"], before["switch_measured"]) == (
            "coder-w", 0, False)  # fmt: skip
        body = {"model": "chat", "prompt": "hi", "max_tokens": 4, "stream": True}
        comments, data = [], []
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith(":"):
                    comments.append(line)
                elif line.startswith("data:"):
                    data.append(line)
        assert data[-1] == "data: [DONE]" and len(data) >= 2
        woken = [c for c in comments if "waking model `chat` (swap group gpu0" in c]
        assert len(woken) >= 2, comments  # the first at once, a keep-alive during the wake
        assert "held by `coder`" in woken[0] and "switch takes" in woken[0]
        group = _groups(gw)["gpu0"]
        assert group["holder"] == "chat-w" and group["switches"] == 1
        assert group["switch_measured"] and group["last_switch_s"] >= 6.0
        assert group["last_switch_at"] <= time.time()
        _clean(gw, tmp_path)


def test_a_429_for_a_sleeping_model_says_when_to_retry_from_the_switch_time(
    tmp_path: Path,
) -> None:
    cfg = two_model_config(tmp_path)
    cfg["workers"][1]["launch"]["args"]["wake-s"] = 3.0
    with serving(cfg, tmp_path) as gw, ThreadPoolExecutor(1) as pool:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        body = {"model": "chat", "prompt": "hi", "max_tokens": 4}
        patient = pool.submit(httpx.post, gw.url + "/v1/completions", json=body, timeout=60)
        _queued(gw, "chat")
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30,
                       headers={"x-gpupool-max-wait": "0.2"})  # fmt: skip
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"  # the switch's estimate: none measured yet
        assert patient.result(timeout=60).status_code == 200
        _clean(gw, tmp_path)


def test_an_admin_wake_the_policy_will_undo_says_so(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path)
    # chat-w's wake takes 3 s: the coder request that waits meanwhile is seen waiting (a 0.25 s
    # switch let a loaded machine's polls miss it: the policy had switched back already)
    cfg["workers"][1]["launch"]["args"]["wake-s"] = 3.0
    with serving(cfg, tmp_path) as gw, ThreadPoolExecutor(2) as pool:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        body = {"model": "coder", "prompt": "hi", "max_tokens": 150, "stream": True}
        started = threading.Event()

        def long_stream() -> int:
            with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()
            return r.status_code

        running = pool.submit(long_stream)
        assert started.wait(30)
        wake = pool.submit(httpx.post, gw.url + "/admin/workers/chat-w/wake", timeout=60)
        wait_states(gw, {"coder-w": "falling_asleep"})  # its running stream finishes first
        short = {"model": "coder", "prompt": "hi", "max_tokens": 2}
        with ThreadPoolExecutor(1) as later:
            waiting = later.submit(httpx.post, gw.url + "/v1/completions", json=short, timeout=60)
            _queued(gw, "coder")
            reply = wake.result(timeout=60).json()
            assert reply["state"] == "ready"
            assert "wait for `coder`" in (reply["policy_note"] or ""), reply
            assert "gives the GPU back" in reply["policy_note"]
            assert waiting.result(timeout=60).status_code == 200
        assert running.result(timeout=60) == 200
        quiet = httpx.post(gw.url + "/admin/workers/chat-w/wake", timeout=60).json()
        assert quiet["policy_note"] is None  # nothing waits elsewhere: it stands
        assert workers(gw)["chat-w"]["state"] == "ready"
        _clean(gw, tmp_path)
