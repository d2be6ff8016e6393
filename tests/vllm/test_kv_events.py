"""Precise prefix routing on real vLLM (CPU) workers launched by `gpupool serve` (issue 34).

Two workers of the tiny dense model publish their KV-cache events (``routing.kv_events``) and
report ``prompt_tokens_details.cached_tokens``; each holds 48 blocks of 128 tokens, less than
the workload's tenants' prefixes together. The gateway's predicted cached tokens for every
precisely routed request are compared with vLLM's report in ``gpupool_kv_predictions_total``.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.procs import Proc, gateway, running
from tests.vllm.conftest import _paths

MODEL = "tiny"
BLOCKS = 48
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
    "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi",
]  # fmt: skip


def _worker(name: str, model_dir: str, py: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "launch": {
            "model_path": model_dir,
            "command": [py, "-m", "vllm.entrypoints.openai.api_server", "--model", "{model_path}"],
            "args": {
                "dtype": "bfloat16",
                "max-model-len": 2048,
                "max-num-seqs": 4,
                "max-num-batched-tokens": 2048,
                "enable-prompt-tokens-details": True,
                "num-gpu-blocks-override": BLOCKS,
            },
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            "startup_timeout_s": 300,
            "backoff_initial_s": 0.5,
        },
    }


@pytest.fixture(scope="module")
def kv_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    tmp = tmp_path_factory.mktemp("kv")
    dense = str(models / "qwen3-dense")
    cfg = {
        "models": [{"name": MODEL}],
        "workers": [_worker("w1", dense, str(py)), _worker("w2", dense, str(py))],
        "routing": {"health_interval_s": 1.0, "kv_events": {"enabled": True}},
    }
    gw = gateway(cfg, tmp)
    with running(gw):
        _wait_precise(gw, ("w1", "w2"), 420)
        yield gw


def _workers(gw: Proc) -> dict[str, dict[str, Any]]:
    data = httpx.get(gw.url + "/admin/workers", timeout=10).json()["data"]
    return {w["name"]: w for w in data}


def _wait_precise(gw: Proc, names: tuple[str, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        seen = _workers(gw)
        if all(seen[n]["state"] == "ready" and seen[n]["kv"]["precise"] for n in names):
            return
        time.sleep(0.5)
    raise TimeoutError(f"not precise: {seen}\n{gw.logs()}")


def _metric(gw: Proc, name: str) -> dict[str, float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def _outcomes(gw: Proc) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in _metric(gw, "gpupool_kv_predictions_total").items():
        outcome = re.search(r'outcome="([^"]+)"', labels)
        assert outcome is not None
        out[outcome[1]] = out.get(outcome[1], 0.0) + v
    return out


def _prefix(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _ask(gw: Proc, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    r = httpx.post(gw.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_predicted_cached_tokens_equal_vllms(kv_stack: Proc) -> None:
    """A mixed multi-tenant workload (10 tenants' long prefixes > one worker's 48 blocks, salted
    and unsalted, chat and completions, two at a time): predicted == reported for >= 95 %."""
    gw = kv_stack
    rng = random.Random(34)
    tenants = [(_prefix(rng, 600), f"t{i}" if i % 2 else None) for i in range(10)]
    before = _outcomes(gw)

    def one(i: int) -> int:
        prefix, salt = tenants[rng.randrange(len(tenants))]
        question = f"question {i}: " + _prefix(rng, 12)
        extra = {"cache_salt": salt} if salt else {}
        if i % 4 == 3:
            body = {"prompt": prefix + " " + question, **extra}
            got = _ask(gw, body, "/v1/completions")
        else:
            msgs = [{"role": "user", "content": prefix + "\n" + question}]
            got = _ask(gw, {"messages": msgs, **extra})
        return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])

    with ThreadPoolExecutor(2) as pool:
        reported = list(pool.map(one, range(60)))
    after = _outcomes(gw)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = sum(delta.values())
    print("kv predictions:", delta, "cache hits reported:", sum(1 for r in reported if r))
    assert total == 60, (delta, gw.logs())
    assert sum(1 for r in reported if r) >= 5  # the workload does reuse prefixes (12 to 19 seen)
    assert delta.get("exact", 0) / total >= 0.95, delta
    workers = _workers(gw)
    assert all(workers[n]["kv"]["blocks"] > 0 for n in ("w1", "w2")), workers


def test_tenants_with_different_salts_never_share(kv_stack: Proc) -> None:
    gw = kv_stack
    text = _prefix(random.Random(7), 500)
    msgs = [{"role": "user", "content": text}]
    before = _outcomes(gw)
    first = _ask(gw, {"messages": msgs, "cache_salt": "tenant-a"})
    again = _ask(gw, {"messages": msgs, "cache_salt": "tenant-a"})
    other = _ask(gw, {"messages": msgs, "cache_salt": "tenant-b"})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # routed to its cache
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = _outcomes(gw)
    assert after.get("exact", 0) - before.get("exact", 0) == 3  # predicted 0, n, 0


def test_fallback_is_visible(kv_stack: Proc) -> None:
    """A request whose prompt is not modelled (a message's ``name``) routes approximately, and
    says why."""
    gw = kv_stack
    _ask(gw, {"messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    modes = _metric(gw, "gpupool_kv_routed_requests_total")
    assert any("approximate: a message other than role and text content" in k for k in modes), modes
    assert any('mode="precise"' in k for k in modes), modes


def test_restart_empties_the_index(kv_stack: Proc) -> None:
    gw = kv_stack
    assert _workers(gw)["w1"]["kv"]["blocks"] > 0
    r = httpx.post(gw.url + "/admin/workers/w1/restart", timeout=60)
    assert r.status_code == 200, r.text
    w1 = _workers(gw)["w1"]
    assert w1["kv"]["blocks"] == 0, w1
    _wait_precise(gw, ("w1",), 300)
    assert _workers(gw)["w1"]["kv"]["blocks"] == 0
    msgs = [{"role": "user", "content": _prefix(random.Random(9), 400)}]
    for _ in range(2):
        _ask(gw, {"messages": msgs})
    assert sum(w["kv"]["blocks"] for w in _workers(gw).values()) > 0
