"""Two models taking turns on one (simulated) GPU through gpupool: `gpupool serve`, launched
`gpupool sim` workers with sleep mode and a shared-GPU ledger, the openai client.

Every test checks the invariants after the fact from the sims' own ledger (no start or wake
while the other held the GPU, no request reached a sleeping worker, no sleep aborted a
generation, and none even found one running: the gateway asked each only once its own requests
there had ended, so no stream was cut by a switch) and, while it runs, from /admin/workers
(never two members of the group awake)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import RedisServer
from tests.gateway.swap.tools import (
    Sampler,
    launched,
    ledger_of,
    metric,
    sdk,
    serving,
    sleeps_waited,
    two_model_config,
    wait_states,
    workers,
)
from tests.support.procs import Proc, running, sim


def _clean(tmp: Path) -> None:
    ledger = ledger_of(tmp)
    assert ledger["violations"] == []
    assert ledger["peak_awake"] <= 1.0
    assert set(sleeps_waited(ledger).values()) <= {0}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Proc]:
    with serving(two_model_config(tmp_path), tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        yield gw


def test_start_up_in_turn_ends_with_the_first_awake(stack: Proc, tmp_path: Path) -> None:
    seen = workers(stack)
    assert {n: w["state"] for n, w in seen.items()} == {"coder-w": "ready", "chat-w": "asleep"}
    assert {w["swap_group"] for w in seen.values()} == {"gpu0"}  # formed from 0.85 + 0.85
    assert len(ledger_of(tmp_path)["members"]) == 2  # both started (one after the other)
    models = {m.id for m in sdk(stack).models.list().data}
    assert models == {"coder", "chat"}  # a sleeping model is listed: it is served on demand
    assert httpx.get(stack.url + "/ready").status_code == 200
    _clean(tmp_path)


def _ask(client: openai.OpenAI, model: str, stream: bool) -> str:
    if stream:
        chunks = client.completions.create(model=model, prompt="hi", max_tokens=6, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=model, prompt="hi", max_tokens=6).choices[0].text


def _mixed_load(gw: Proc, n: int) -> list[str]:
    client = sdk(gw)
    rng = random.Random(7)
    jobs = [(rng.choice(["coder", "chat"]), rng.random() < 0.5) for _ in range(n)]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda j: _ask(client, *j), jobs))


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_mixed_load_switches_without_a_failure(
    tmp_path: Path, backend: str, redis_server: RedisServer
) -> None:
    queue: dict[str, Any] = {"backend": backend}
    if backend == "redis":
        queue |= {"redis_url": redis_server.url, "redis_prefix": f"swap-{tmp_path.name}"}
    with serving(two_model_config(tmp_path, queue=queue), tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        with Sampler(gw) as sampler:
            answers = _mixed_load(gw, 48)
        assert len(answers) == 48 and all(answers)
        assert sampler.samples > 10 and sampler.most_awake == 1
        switches = metric(gw, "gpupool_swap_switches_total")
        assert switches >= 1
        assert metric(gw, "gpupool_swap_switch_seconds_count") == switches
        assert metric(gw, "gpupool_swap_waited_requests_total") >= 1
        assert metric(gw, "gpupool_worker_asleep_seconds") > 0
        held = httpx.get(gw.url + "/admin/held").json()
        assert set(held["inflight"].values()) == {0}
    _clean(tmp_path)


def test_a_stream_in_flight_finishes_before_its_worker_sleeps(tmp_path: Path) -> None:
    # `turns` switches while coder-w streams (`weighed` would wait for the stream's end first)
    with serving(two_model_config(tmp_path, swap={"policy": "turns"}), tmp_path) as stack:
        wait_states(stack, {"coder-w": "ready", "chat-w": "asleep"})
        _stream_finishes_first(stack, tmp_path)


def _stream_finishes_first(stack: Proc, tmp_path: Path) -> None:
    client = sdk(stack)
    stream = client.completions.create(model="coder", prompt="hi", max_tokens=120, stream=True)
    chunks = iter(stream)
    first = next(chunks)  # running on coder-w (10 ms a token: over a second to go)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(_ask, client, "chat", False)
        wait_states(stack, {"coder-w": "falling_asleep"}, timeout=30)  # the switch is asked for
        assert workers(stack)["coder-w"]["inflight"] == 1
        rest = [c.choices[0].text for c in chunks if c.choices]
        assert other.result(timeout=60)
    text = first.choices[0].text + "".join(rest)
    assert len(rest) == 119 and text  # every token came, then [DONE]
    assert workers(stack)["chat-w"]["state"] == "ready"
    _clean(tmp_path)


def test_admin_sleep_and_wake(stack: Proc, tmp_path: Path) -> None:
    r = httpx.post(stack.url + "/admin/workers/chat-w/wake", timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "ready"
    assert workers(stack)["coder-w"]["state"] == "asleep"
    r = httpx.post(stack.url + "/admin/workers/chat-w/sleep?level=2", timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "asleep"
    chat = r.json()["url"]
    assert httpx.get(chat + "/sim/sleep").json()["level"] == 2  # this time only
    assert _ask(sdk(stack), "coder", False)  # woken on demand
    assert _ask(sdk(stack), "chat", False)  # a level-2 wake: weights reloaded
    stats = httpx.get(chat + "/sim/sleep").json()
    assert (stats["asleep"], stats["wakes"]) == (False, 2)
    r = httpx.post(stack.url + "/admin/workers/nobody/sleep")
    assert r.status_code == 404
    r = httpx.post(stack.url + "/admin/workers/chat-w/sleep?level=3")
    assert r.status_code == 400 and r.json()["error"]["param"] == "level"


def test_level_2_is_refused_for_dummy_weights(tmp_path: Path) -> None:
    """vLLM cannot reload `load-format: dummy` weights, so a level-2 wake would fail and
    restart the worker: the admin refuses `?level=2` for such a worker, saying why, and the
    worker stays as it was; level 1 still works."""
    cfg = two_model_config(tmp_path)
    cfg["workers"][1]["launch"]["args"]["load-format"] = "dummy"
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        r = httpx.post(gw.url + "/admin/workers/chat-w/sleep?level=2", timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "level"
        assert "cannot reload" in error["message"] and "chat-w" in error["message"]
        assert workers(gw)["chat-w"]["state"] == "asleep"
        assert httpx.post(gw.url + "/admin/workers/chat-w/wake", timeout=60).status_code == 200
        r = httpx.post(gw.url + "/admin/workers/chat-w/sleep?level=1", timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "asleep"
    _clean(tmp_path)
    _clean(tmp_path)


def test_idle_worker_sleeps_and_wakes_on_demand(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path)
    cfg["workers"][0]["sleep"] = {"level": 1, "idle_s": 0.5}
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "asleep", "chat-w": "asleep"})  # idle: the GPU is free
        assert _ask(sdk(gw), "coder", True)  # answered: it woke on demand (the GPU was free)
        # (not read back as `ready`: 0.5 s after its answer it is idle again, and on a loaded
        # machine it was already falling asleep when asked)
        wait_states(gw, {"coder-w": "asleep"})
    _clean(tmp_path)


@pytest.mark.parametrize("how", ["error", "crash"])
def test_a_failed_wake_restarts_the_worker_and_serves(
    stack: Proc, tmp_path: Path, how: str
) -> None:
    chat = workers(stack)["chat-w"]
    httpx.post(chat["url"] + "/sim/sleep", json={"wake_fail": how}).raise_for_status()
    assert _ask(sdk(stack), "chat", False)  # waits through the failure and the restart
    after = workers(stack)["chat-w"]
    assert after["state"] == "ready" and after["restarts"] + (after["pid"] != chat["pid"]) >= 1
    assert "wake failed" in (after["last_error"] or "wake failed")
    assert workers(stack)["coder-w"]["state"] == "asleep"
    _clean(tmp_path)


def test_url_workers_found_awake_are_put_to_sleep_but_one(tmp_path: Path) -> None:
    a = sim(model="coder", tmp=tmp_path, enable_sleep_mode=True, itl_ms=5)
    b = sim(model="chat", tmp=tmp_path, enable_sleep_mode=True, itl_ms=5)
    cfg = {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": [
            {"name": "a", "model": "coder", "url": a.url, "swap_group": "shared"},
            {"name": "b", "model": "chat", "url": b.url, "swap_group": "shared"},
        ],
        "routing": {"health_interval_s": 0.3, "metrics_interval_s": 3600},
        "swap": {"min_awake_s": 0.2},
    }
    with running(a, b):
        assert httpx.get(b.url + "/is_sleeping").json() == {"is_sleeping": False}
        with serving(cfg, tmp_path) as gw:
            wait_states(gw, {"a": "ready", "b": "asleep"})
            assert httpx.get(b.url + "/is_sleeping").json() == {"is_sleeping": True}
            with Sampler(gw) as sampler:
                assert _ask(sdk(gw), "chat", True)
                assert _ask(sdk(gw), "coder", False)
            assert sampler.most_awake == 1
            assert httpx.get(b.url + "/sim/sleep").json()["violations"] == []
            assert httpx.get(a.url + "/sim/sleep").json()["violations"] == []


def test_waiting_for_a_switch_is_visible_and_times_out_honestly(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path)
    cfg["workers"][1]["launch"]["args"]["wake-s"] = 2.0  # chat-w takes 2 s to wake
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        client = sdk(gw)
        with ThreadPoolExecutor(1) as pool:
            patient = pool.submit(_ask, client, "chat", True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the waiting request shows in the queue
                queue = httpx.get(gw.url + "/admin/queue").json()
                if queue["models"].get("chat", {}).get("depth"):
                    break
                time.sleep(0.02)
            else:
                raise AssertionError(f"never queued: {queue}")
            r = httpx.post(
                gw.url + "/v1/completions",
                json={"model": "chat", "prompt": "hi", "max_tokens": 4},
                headers={"x-gpupool-max-wait": "0.2"}, timeout=30,
            )  # fmt: skip
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["message"].startswith("No slot for model `chat`")
            assert patient.result(timeout=60)  # waited through the switch
        held = httpx.get(gw.url + "/admin/held").json()
        assert set(held["inflight"].values()) == {0} and set(held["queued"].values()) <= {0}
    _clean(tmp_path)


def test_a_reload_that_changes_both_members_keeps_them_taking_turns(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path)
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        for w in cfg["workers"]:
            w["launch"]["args"]["itl-ms"] = 5  # a changed worker is replaced
        path = next(tmp_path.glob("gpupool-*.yaml"))
        served = yaml.safe_load(path.read_text())
        served["workers"] = cfg["workers"]
        path.write_text(yaml.safe_dump(served))
        with Sampler(gw) as sampler:
            r = httpx.post(gw.url + "/admin/reload", timeout=120)
            assert r.status_code == 200, r.text
            assert sorted(r.json()["workers"]["changed"]) == ["chat-w", "coder-w"]
            assert _ask(sdk(gw), "chat", False)
            assert _ask(sdk(gw), "coder", True)
        assert sampler.most_awake == 1
        seen = workers(gw)
        assert {w["swap_group"] for w in seen.values()} == {"gpu0"}
        assert sorted(w["state"] for w in seen.values()) == ["asleep", "ready"]
    _clean(tmp_path)


def test_a_reload_that_adds_a_member_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """The swap groups are built at start: a worker they do not know could be awake beside the
    holder. Reload says a restart is needed, and nothing changes."""
    cfg = two_model_config(tmp_path)
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        path = next(tmp_path.glob("gpupool-*.yaml"))
        served = yaml.safe_load(path.read_text())
        ledger = tmp_path / "gpu0-ledger.json"
        served["models"].append({"name": "vision"})
        served["workers"].append(launched("vision-w", "vision", ledger))
        path.write_text(yaml.safe_dump(served))
        r = httpx.post(gw.url + "/admin/reload", timeout=60)
        assert r.status_code == 400 and "restart" in r.text, r.text
        assert set(workers(gw)) == {"coder-w", "chat-w"}
        assert _ask(sdk(gw), "chat", False)  # the group still takes turns
    _clean(tmp_path)


def test_a_lone_url_worker_sleeps_when_idle_and_wakes_for_a_request(tmp_path: Path) -> None:
    a = sim(model="coder", tmp=tmp_path, enable_sleep_mode=True)
    cfg = {
        "models": [{"name": "coder"}],
        "workers": [{"name": "a", "model": "coder", "url": a.url, "sleep": {"idle_s": 0.5}}],
        "routing": {"health_interval_s": 0.3, "metrics_interval_s": 3600},
    }
    with running(a), serving(cfg, tmp_path) as gw:
        wait_states(gw, {"a": "asleep"})  # idle: the GPU is free for other programs
        assert httpx.get(a.url + "/is_sleeping").json() == {"is_sleeping": True}
        assert _ask(sdk(gw), "coder", True)
        assert httpx.get(a.url + "/sim/sleep").json()["wakes"] == 1
        wait_states(gw, {"a": "asleep"})
        assert httpx.get(a.url + "/sim/sleep").json()["violations"] == []


def test_a_failed_sleep_restarts_the_worker_before_the_other_wakes(
    stack: Proc, tmp_path: Path
) -> None:
    coder = workers(stack)["coder-w"]
    httpx.post(coder["url"] + "/sim/sleep", json={"sleep_fail": "error"}).raise_for_status()
    with Sampler(stack) as sampler:
        assert _ask(sdk(stack), "chat", False)  # coder-w killed (its GPU memory freed) first
        after = workers(stack)["coder-w"]
        assert after["restarts"] >= 1 or after["pid"] != coder["pid"]
        assert after["state"] in ("starting", "stopped", "failed")  # its relaunch waits its turn
        assert _ask(sdk(stack), "coder", True)  # its turn: launched, then served
    assert sampler.most_awake == 1
    assert workers(stack)["chat-w"]["state"] == "asleep"
    _clean(tmp_path)
