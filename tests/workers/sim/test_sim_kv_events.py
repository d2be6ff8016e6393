"""The simulator publishes vLLM's KV-cache events from its prefix cache, and ``gpupool serve``
routes precisely on them: a prompt one simulated worker cached (sent to it directly, around the
gateway) goes back to it, though load and name would pick the other. A drain and its resume keep
what the index learned (the process and its cache stay up); a sleep empties it, and it stays
empty after the wake (the real-vLLM suite cannot sleep: the CPU build has no sleep mode)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.procs import ROOT, Proc, gateway, running

DENSE = ROOT / ".models" / "qwen3-dense"
pytestmark = pytest.mark.skipif(not (DENSE / "tokenizer.json").exists(), reason="no tiny models")
SYSTEM = "You answer briefly. " + "a shared system prompt of many words " * 60


def _launched(name: str, **extra: Any) -> dict[str, Any]:
    return {
        **extra,
        "name": name,
        "model": "m",
        "launch": {
            "model_path": str(DENSE),
            "command": [sys.executable, "-m", "gpupool.workers.sim", "--tokenizer", "{model_path}"],
            "args": {"max-num-seqs": 4, "output-tokens": 4},
            "startup_timeout_s": 60,
            "stop_timeout_s": 5,
        },
    }


def _until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": "m"}],
        # a sleeps on its own (a swap group of one): /admin/workers/a/sleep and /wake
        "workers": [_launched("a", swap_group="a-gpu"), _launched("b")],
        "routing": {"health_interval_s": 0.3, "metrics_interval_s": 0.3,
                    "kv_events": {"enabled": True}},
    }  # fmt: skip
    proc = gateway(cfg, tmp_path_factory.mktemp("simkv"))
    with running(proc):
        _until(lambda: _precise(proc), "both precise")
        yield proc


def _precise(gw: Proc) -> bool:
    workers = _workers(gw)
    return len(workers) == 2 and all(w["kv"]["precise"] for w in workers.values())


def _workers(gw: Proc) -> dict[str, dict[str, Any]]:
    data = httpx.get(gw.url + "/admin/workers", timeout=5).json()["data"]
    return {w["name"]: w for w in data if w["state"] == "ready"} if len(data) == 2 else {}


def _chat(question: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}  # fmt: skip


def test_a_prompt_goes_to_the_simulated_worker_that_cached_it(gw: Proc) -> None:
    b = _workers(gw)["b"]
    direct = httpx.post(b["url"] + "/v1/chat/completions", json=_chat("first?"), timeout=30)
    assert direct.status_code == 200, direct.text
    _until(lambda: _workers(gw)["b"]["kv"]["blocks"] > 0, "b's blocks indexed")
    assert _workers(gw)["a"]["kv"]["blocks"] == 0
    r = httpx.post(gw.url + "/v1/chat/completions", json=_chat("second?"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-gpupool-worker"] == "b"  # on a tie by load, "a" comes first by name
    kv = _workers(gw)["b"]["kv"]
    assert kv["precise"] and kv["gaps"] == 0 and kv["resyncs"] == 0, kv


def _worker(gw: Proc, name: str) -> dict[str, Any]:
    return dict(httpx.get(f"{gw.url}/admin/workers/{name}", timeout=5).json())


def _admin(gw: Proc, name: str, action: str) -> dict[str, Any]:
    r = httpx.post(f"{gw.url}/admin/workers/{name}/{action}", timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _cached_on(gw: Proc, name: str, question: str) -> int:
    """Send a prompt to the worker directly; return the blocks its index then holds."""
    w = _worker(gw, name)
    before = w["kv"]["blocks"]
    direct = httpx.post(w["url"] + "/v1/chat/completions", json=_chat(question), timeout=30)
    assert direct.status_code == 200, direct.text
    _until(lambda: _worker(gw, name)["kv"]["blocks"] > before, f"{name}'s blocks indexed")
    return int(_worker(gw, name)["kv"]["blocks"])


def test_a_drain_and_its_resume_keep_the_index(gw: Proc) -> None:
    """The drained worker's simulator keeps its cache: Resume finds the index as it was, and the
    prompt it holds goes back to it."""
    blocks = _cached_on(gw, "b", "drained?")
    assert _admin(gw, "b", "drain")["state"] == "draining"
    assert _worker(gw, "b")["kv"]["blocks"] == blocks
    assert _admin(gw, "b", "undrain")["state"] == "ready"
    kv = _worker(gw, "b")["kv"]
    assert kv["blocks"] == blocks and kv["precise"], kv
    r = httpx.post(gw.url + "/v1/chat/completions", json=_chat("resumed?"), timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-gpupool-worker"] == "b"


def test_a_sleep_empties_the_index_and_the_wake_finds_it_empty(gw: Proc) -> None:
    """The simulator clears its prefix cache as vLLM's sleep does (publishing
    ``AllBlocksCleared``); the gateway empties the index on the sleep itself."""
    first = _cached_on(gw, "a", "sleepy?")
    _admin(gw, "a", "sleep")
    _until(lambda: _worker(gw, "a")["state"] == "asleep", "a asleep")
    assert _worker(gw, "a")["kv"]["blocks"] == 0
    _admin(gw, "a", "wake")
    _until(lambda: _worker(gw, "a")["state"] == "ready", "a awake")
    kv = _worker(gw, "a")["kv"]
    assert kv["blocks"] == 0 and kv["precise"], kv  # nothing cached, and it knows so
    assert _cached_on(gw, "a", "sleepy?") == first  # the same prompt is stored again, whole


def _routed(gw: Proc, mode: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    key = f'gpupool_kv_routed_requests_total{{mode="{mode}",model="m"}}'
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(key))


def test_a_request_that_wakes_a_worker_is_predicted_on_its_emptied_index(gw: Proc) -> None:
    """With ``a`` asleep and ``b`` drained, a request waits for ``a``'s wake. The sleep emptied
    ``a``'s index as it emptied the cache, so the request is predicted on it (0 cached tokens,
    what vLLM finds after a wake: measured on the H100, docs/gpu.md), not routed approximately."""
    _admin(gw, "a", "sleep")
    _until(lambda: _worker(gw, "a")["state"] == "asleep", "a asleep")
    assert _admin(gw, "b", "drain")["state"] == "draining"
    try:
        precise, approximate = (
            _routed(gw, "precise"),
            _routed(gw, "approximate: no worker is known exactly"),
        )
        r = httpx.post(gw.url + "/v1/chat/completions", json=_chat("woken?"), timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-gpupool-worker"] == "a"
        assert _routed(gw, "precise") == precise + 1
        assert _routed(gw, "approximate: no worker is known exactly") == approximate
    finally:
        assert _admin(gw, "b", "undrain")["state"] == "ready"
