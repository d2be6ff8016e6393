"""A ``url:`` member's sleep that frees nothing (issue 37): gpupool names none of its processes,
so its sleep is read through the group's GPU, which a launched member of the group names: after
the /sleep the device must have room for the launched member's share (the planner's figure).
Here ``a`` (coder, ``url:``) and ``chat-w`` (launched) share one simulated GPU at 0.85 each;
``a``'s /sleep answers 200 and keeps its memory. The group must not wake ``chat-w`` beside it
(the ledger would record the CUDA out-of-memory wake): ``a`` is marked failed, saying why, and
read again; once it really sleeps, ``chat-w`` wakes and the waiting request is served."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.swap.tools import launched, ledger_of, sdk, serving, wait_states, workers
from tests.support.procs import running, sim


def _config(tmp: Path, a_url: str) -> dict[str, Any]:
    chat = launched("chat-w", "chat", tmp / "gpu0-ledger.json")
    chat["swap_group"] = "shared"
    return {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": [{"name": "a", "model": "coder", "url": a_url, "swap_group": "shared"}, chat],
        "routing": {"health_interval_s": 0.3, "health_timeout_s": 2, "metrics_interval_s": 3600},
        "swap": {"min_awake_s": 0, "free_timeout_s": 1},
        "queue": {"max_wait_s": 120},
    }


def test_a_url_members_sleep_that_frees_nothing_never_wakes_the_other_beside_it(
    tmp_path: Path,
) -> None:
    ledger = str(tmp_path / "gpu0-ledger.json")
    a = sim(model="coder", tmp=tmp_path, enable_sleep_mode=True, itl_ms=5,
            gpu_memory_utilization=0.85, sleep_ledger=ledger)  # fmt: skip
    with running(a), serving(_config(tmp_path, a.url), tmp_path) as gw:
        client = sdk(gw)
        assert client.completions.create(model="coder", prompt="hi", max_tokens=4).choices
        wait_states(gw, {"a": "ready", "chat-w": "asleep"})
        assert workers(gw)["chat-w"]["swap"]["sleep_check"] in ("freed", None)
        knob = {"sleep_fail": "keep_memory"}  # /sleep says 200 and "asleep"; memory stays
        httpx.post(a.url + "/sim/sleep", json=knob, timeout=10).raise_for_status()
        with ThreadPoolExecutor(1) as pool:
            chat = pool.submit(
                lambda: client.completions.create(model="chat", prompt="hi", max_tokens=4)
            )
            seen = wait_states(gw, {"a": "failed", "chat-w": "asleep"}, timeout=30)
            failure = seen["a"]["swap"]["verify_failure"] or ""
            assert "no room for the 0.85" in failure, seen["a"]
            assert seen["a"]["swap"]["sleep_check"] == "held"
            time.sleep(2)  # a few reads of `a` at the health pace: still no room, no wake
            assert workers(gw)["chat-w"]["state"] == "asleep" and not chat.done()
            assert ledger_of(tmp_path)["violations"] == []
            # `a` recovers (its operator fixes it): woken, then put to sleep by its group,
            # which now frees its memory; chat-w wakes and the waiting request is answered
            httpx.post(a.url + "/sim/sleep", json={"sleep_fail": None}, timeout=10)
            httpx.post(a.url + "/wake_up", timeout=10).raise_for_status()
            assert chat.result(timeout=60).choices
        wait_states(gw, {"a": "asleep", "chat-w": "ready"})
        ledger = ledger_of(tmp_path)
        assert ledger["violations"] == [] and ledger["peak_awake"] <= 1.0
        held = httpx.get(gw.url + "/admin/held", timeout=10).json()
        assert set(held["inflight"].values()) <= {0} and set(held["queued"].values()) <= {0}
