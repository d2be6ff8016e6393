"""A ``url:`` member holding its group's GPU that fails: gpupool did not launch it, so the GPU is
free only once the worker itself says it sleeps (its /sleep answered, or /is_sleeping).

Two `gpupool sim` workers with sleep mode share one simulated GPU through a ledger (0.85 each: a
wake beside an awake one fails as CUDA does and is recorded); `gpupool serve` has them as
``url:`` members of one swap group, ``a`` (coder) awake, ``b`` (chat) asleep. Each fault is
checked from the sims themselves (/is_sleeping, the ledger's violations and peak), not only
from the gateway's states, and nothing is held afterwards."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RedisServer
from tests.gateway.swap.tools import (
    Sampler,
    ledger_of,
    serving,
    sleeps_waited,
    wait_states,
    workers,
)
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, running, sim

pytestmark = pytest.mark.timing  # a holder unreachable or hanging for seconds, timeouts of 1 s

WAITS = "waits for it"  # the holder's last_error while its group waits for it


@contextmanager
def url_pair(tmp: Path, **extra: Any) -> Iterator[tuple[Proc, Proc, Proc]]:
    """The gateway, ``a`` (coder, awake, holding the GPU) and ``b`` (chat, asleep)."""
    opts: dict[str, Any] = {"tmp": tmp, "enable_sleep_mode": True, "itl_ms": 5,
                            "gpu_memory_utilization": 0.85,
                            "sleep_ledger": str(tmp / "gpu0-ledger.json")}  # fmt: skip
    a, b = sim(model="coder", **opts), sim(model="chat", **opts)
    sleep = {"level": extra.get("a_level", 1)}
    cfg: dict[str, Any] = {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": [
            {"name": "a", "model": "coder", "url": a.url, "swap_group": "shared", "sleep": sleep},
            {"name": "b", "model": "chat", "url": b.url, "swap_group": "shared"},
        ],
        "routing": {"health_interval_s": 0.3, "health_timeout_s": 2, "metrics_interval_s": 3600},
        "swap": {"min_awake_s": 0, "sleep_timeout_s": 1, **extra.get("swap", {})},
        "queue": {"max_wait_s": 60, **extra.get("queue", {})},
    }
    with running(b):
        httpx.post(b.url + "/sleep?level=1", timeout=10).raise_for_status()  # a fits beside it
        with running(a), serving(cfg, tmp) as gw:
            wait_states(gw, {"a": "ready", "b": "asleep"})
            yield gw, a, b


def sleeping(p: Proc) -> bool:
    answer: bool = httpx.get(p.url + "/is_sleeping", timeout=10).json()["is_sleeping"]
    return answer


def ask(gw: Proc, model: str) -> str:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=90)
    return client.completions.create(model=model, prompt="hi", max_tokens=6).choices[0].text


def until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what}")
        time.sleep(0.05)


def queued(gw: Proc, model: str) -> bool:
    snap = httpx.get(gw.url + "/admin/queue", timeout=10).json()
    return bool(snap["models"].get(model, {}).get("depth"))


def clean(gw: Proc, tmp: Path) -> None:
    ledger = ledger_of(tmp)
    assert ledger["violations"] == []  # no wake (or request) while the other held the GPU
    assert ledger["peak_awake"] <= 1.0
    assert set(sleeps_waited(ledger).values()) <= {0}  # no sleep found a request running
    assert_nothing_held(gw.url)


def test_a_sleep_that_fails_keeps_the_gpu_until_a_second_one_answers(tmp_path: Path) -> None:
    with url_pair(tmp_path) as (gw, a, b):
        httpx.post(a.url + "/sim/sleep", json={"sleep_fail": "error"}).raise_for_status()
        with Sampler(gw) as sampler:
            assert ask(gw, "chat")  # served once a's next /sleep answered, not before
        log = gw.log_path.read_text()
        assert "sleep failed: POST sleep?level=1&mode=wait answered 500" in log
        assert (sleeping(a), sleeping(b)) == (True, False)
        seen = workers(gw)
        assert (seen["a"]["state"], seen["a"]["last_error"], seen["b"]["state"]) == (
            "asleep", None, "ready")  # fmt: skip
        assert sampler.most_awake == 1
        assert ask(gw, "coder")  # and back
        clean(gw, tmp_path)


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_sleep_that_hangs_past_its_timeout_keeps_the_other_asleep(
    tmp_path: Path, backend: str, redis_server: RedisServer
) -> None:
    queue: dict[str, Any] = {"backend": backend}
    if backend == "redis":
        queue |= {"redis_url": redis_server.url, "redis_prefix": f"swap-{tmp_path.name}"}
    with url_pair(tmp_path, queue=queue) as (gw, a, b):
        httpx.post(a.url + "/sim/sleep", json={"sleep_fail": "hang"}).raise_for_status()
        r = httpx.post(
            gw.url + "/v1/completions",
            json={"model": "chat", "prompt": "hi", "max_tokens": 4},
            headers={"x-gpupool-max-wait": "3"}, timeout=30,
        )  # fmt: skip
        assert r.status_code == 429 and r.json()["error"]["message"].startswith("No slot")
        until("waiting for a", lambda: WAITS in (workers(gw)["a"]["last_error"] or ""))
        assert workers(gw)["a"]["state"] == "failed"  # out of routing, still the holder
        assert "no answer in 1 s" in workers(gw)["a"]["last_error"]
        assert (sleeping(a), sleeping(b)) == (False, True)
        with ThreadPoolExecutor(1) as pool:
            patient = pool.submit(ask, gw, "chat")
            until("chat queued", lambda: queued(gw, "chat"))
            assert sleeping(b)
            httpx.post(a.url + "/sim/sleep", json={"sleep_fail": None}).raise_for_status()
            assert patient.result(timeout=90)  # a's sleep went through: then b woke
        assert (sleeping(a), sleeping(b)) == (True, False)
        wait_states(gw, {"a": "asleep", "b": "ready"})
        clean(gw, tmp_path)


def test_a_holder_unreachable_for_a_while_keeps_the_gpu_and_comes_back(tmp_path: Path) -> None:
    with url_pair(tmp_path) as (gw, a, b):
        a.kill(signal.SIGSTOP)  # its weights stay on the GPU; it answers nothing
        try:
            until("a taken out", lambda: WAITS in (workers(gw)["a"]["last_error"] or ""))
            with ThreadPoolExecutor(1) as pool:
                patient = pool.submit(ask, gw, "chat")
                until("chat queued", lambda: queued(gw, "chat"))
                time.sleep(3)  # a few more reads of a, each unanswered
                assert workers(gw)["a"]["state"] == "failed" and sleeping(b)
                a.kill(signal.SIGCONT)
                assert patient.result(timeout=90)  # a answered, was put to sleep, b woke
        finally:
            a.kill(signal.SIGCONT)
        assert (sleeping(a), sleeping(b)) == (True, False)
        assert ask(gw, "coder")  # a holds the GPU again
        a.kill(signal.SIGSTOP)  # out again, nobody else waiting this time
        try:
            until("a taken out", lambda: WAITS in (workers(gw)["a"]["last_error"] or ""))
        finally:
            a.kill(signal.SIGCONT)
        seen = wait_states(gw, {"a": "ready", "b": "asleep"})  # back: ready, read by its group
        assert seen["a"]["last_error"] is None and not sleeping(a) and sleeping(b)
        assert ask(gw, "coder")
        clean(gw, tmp_path)


def test_a_level_2_wake_that_fails_half_way_keeps_the_gpu_until_a_sleep_answers(
    tmp_path: Path,
) -> None:
    """vLLM's /is_sleeping says true while any tag sleeps: after ``wake_up?tags=weights`` and
    ``reload_weights``, a failed ``tags=kv_cache`` leaves a's weights on the GPU though it reads
    as asleep. The group must not take that as proof: b waits until a woke its last tag and a
    /sleep of ours answered."""
    with url_pair(tmp_path, a_level=2) as (gw, a, b):
        assert ask(gw, "chat")  # a sleeps at level 2, b holds the GPU
        assert (sleeping(a), sleeping(b)) == (True, False)
        httpx.post(a.url + "/sim/sleep", json={"wake_fail": "kv_cache"}).raise_for_status()
        with ThreadPoolExecutor(2) as pool:
            coder = pool.submit(ask, gw, "coder")  # a's wake: weights up, kv_cache 500
            until("a failed half-way", lambda: WAITS in (workers(gw)["a"]["last_error"] or ""))
            assert sleeping(a) and sleeping(b)  # both say so; a's weights hold the GPU
            chat = pool.submit(ask, gw, "chat")
            until("chat queued", lambda: queued(gw, "chat"))
            time.sleep(3)  # a few reads of a, each "asleep", each retried wake failing
            assert sleeping(b) and workers(gw)["a"]["state"] == "failed"
            assert "wake (to sleep again" in workers(gw)["a"]["last_error"]
            assert ledger_of(tmp_path)["violations"] == []  # b was never woken beside a
            httpx.post(a.url + "/sim/sleep", json={"wake_fail": None}).raise_for_status()
            assert coder.result(timeout=90) and chat.result(timeout=90)
        assert "wake failed: POST wake_up?tags=kv_cache answered 500" in gw.log_path.read_text()
        assert ask(gw, "coder") and ask(gw, "chat")
        clean(gw, tmp_path)


def test_a_drain_while_its_sleep_runs_is_kept_once_the_sleep_answers(tmp_path: Path) -> None:
    with url_pair(tmp_path, swap={"sleep_timeout_s": 60}) as (gw, a, b):
        httpx.post(a.url + "/sim/sleep", json={"sleep_fail": "hang"}).raise_for_status()
        with ThreadPoolExecutor(1) as pool:
            chat = pool.submit(ask, gw, "chat")
            until("a falling asleep", lambda: workers(gw)["a"]["state"] == "falling_asleep")
            r = httpx.post(gw.url + "/admin/workers/a/drain", timeout=30)
            assert r.status_code == 200 and r.json()["state"] == "stopped"
            httpx.post(a.url + "/sim/sleep", json={"sleep_fail": None}).raise_for_status()
            assert chat.result(timeout=90)  # a's /sleep answered: the GPU went to b
        assert (sleeping(a), sleeping(b)) == (True, False)
        assert workers(gw)["a"]["state"] == "stopped"  # the drain holds: not taken as asleep
        httpx.post(gw.url + "/admin/workers/a/undrain", timeout=30).raise_for_status()
        assert ask(gw, "coder")
        clean(gw, tmp_path)
