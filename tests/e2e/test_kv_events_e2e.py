"""Precise prefix routing through ``gpupool serve`` with fake workers publishing vLLM's
KV-cache events (fast; tests/vllm/test_kv_events.py does it with real vLLM).

Two ``url:`` workers, each with a ``kv_events`` endpoint driven by the test: the request goes
to the worker whose events say it holds the prompt's blocks; another tenant's salt shares none;
a gap the replay cannot fill drops that worker's index and makes it approximate, visibly."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml

from gpupool.workers.kvevents import wire
from gpupool.workers.kvevents.hashing import HashSpec, block_hashes
from gpupool.workers.kvevents.render import PromptRenderer
from tests.support.hostile_tools import serve_in_thread
from tests.support.kv_publisher import KvPublisher
from tests.support.kv_worker import KvWorker
from tests.support.procs import ROOT, Proc, free_port, gateway, running

DENSE = ROOT / ".models" / "qwen3-dense"
pytestmark = pytest.mark.skipif(not (DENSE / "tokenizer.json").exists(), reason="no tiny models")
PROMPT = "You are a careful assistant. " + "the quick brown fox jumps over the lazy dog " * 40


def _until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kve")
    names = ("w1", "w2")
    fakes = {n: KvWorker() for n in names}
    ports = {n: free_port() for n in names}
    pubs = {n: KvPublisher(f"ipc://{tmp}/{n}.pub", f"ipc://{tmp}/{n}.replay", buffer_steps=4)
            for n in names}  # fmt: skip
    workers = [
        {"name": n, "model": "m", "url": f"http://127.0.0.1:{ports[n]}", "max_inflight": 4,
         "kv_events": {"endpoint": f"ipc://{tmp}/{n}.pub", "replay_endpoint":
                       f"ipc://{tmp}/{n}.replay", "hash_seed": "0", "tokenizer": str(DENSE)}}
        for n in names
    ]  # fmt: skip
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": "m"}],
        "workers": workers,
        "routing": {"health_interval_s": 0.5, "metrics_interval_s": 0.2},
    }
    gw = gateway(cfg, tmp)
    try:
        with (
            serve_in_thread(fakes["w1"], ports["w1"]),
            serve_in_thread(fakes["w2"], ports["w2"]),
            running(gw),
        ):
            _until(lambda: all(_kv(gw, n)["precise"] for n in names), "precise")
            yield {"gw": gw, "pubs": pubs, "fakes": fakes, "tmp": tmp}
    finally:
        for p in pubs.values():
            p.close()


def _kv(gw: Proc, name: str) -> dict[str, Any]:
    return dict(httpx.get(f"{gw.url}/admin/workers/{name}", timeout=5).json()["kv"])


def _hashes(salt: str | None = None) -> tuple[list[int], list[int]]:
    ids = PromptRenderer.load(DENSE).prompt_ids("/v1/chat/completions", _body())
    return ids, block_hashes(ids, HashSpec(128, "sha256", "0"), salt)


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": PROMPT}],
            **extra}  # fmt: skip


def _worker_of(gw: Proc, body: dict[str, Any]) -> str:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-gpupool-worker"]


def _publish(pub: KvPublisher, ids: list[int], hashes: list[int]) -> None:
    pub.publish(wire.BlockStored(hashes, None, ids[: 128 * len(hashes)], 128, medium="GPU",
                                 extra_keys=[None] * len(hashes)))  # fmt: skip


def test_the_worker_holding_the_prompt_gets_it(stack: dict[str, Any]) -> None:
    gw, pubs = stack["gw"], stack["pubs"]
    ids, hashes = _hashes()
    assert len(hashes) >= 3
    _until(lambda: _stored(pubs["w2"], ids, hashes, gw), "w2 indexed")
    assert _worker_of(gw, _body()) == "w2"  # w1 ranks first on a tie by name
    before = _outcomes(gw)
    _worker_of(gw, _body(cache_salt="other"))  # another tenant's salt: nothing shared
    after = _outcomes(gw)
    assert after.get("exact", 0) - before.get("exact", 0) == 1, after  # predicted 0, as reported
    assert after.get("over", 0) == 1, after  # the first: predicted cached, the fake says 0
    modes = _metric(gw, "gpupool_kv_routed_requests_total")
    assert modes.get('mode="precise",model="m"', 0) >= 2, modes


def _outcomes(gw: Proc) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in _metric(gw, "gpupool_kv_predictions_total").items():
        outcome = re.search(r'outcome="(\w+)"', labels)
        assert outcome is not None
        out[outcome[1]] = out.get(outcome[1], 0.0) + v
    return out


def _stored(pub: KvPublisher, ids: list[int], hashes: list[int], gw: Proc) -> bool:
    """Publish until the gateway's subscription (which joins asynchronously) holds them."""
    if _kv(gw, "w2")["blocks"] >= len(hashes):
        return True
    _publish(pub, ids, hashes)
    time.sleep(0.2)
    return bool(_kv(gw, "w2")["blocks"] >= len(hashes))


def test_a_gap_past_the_replay_buffer_makes_the_worker_approximate(stack: dict[str, Any]) -> None:
    gw, pub = stack["gw"], stack["pubs"]["w1"]
    _until(lambda: _hello(pub, gw), "w1 subscribed")
    for h in range(10):  # lost on the wire, and more than the 4 batches the replay keeps
        pub.publish(wire.BlockRemoved([h], "GPU"), send=False)
    pub.publish(wire.BlockRemoved([99], "GPU"))
    _until(lambda: _kv(gw, "w1")["resyncs"] == 1, "resync")
    kv = _kv(gw, "w1")
    assert not kv["precise"] and "resync" in kv["reason"], kv
    ids, hashes = _hashes("x")
    pub.publish(wire.BlockStored(hashes[:1], None, ids[:128], 128, medium="GPU",
                                 extra_keys=[["x"]]))  # fmt: skip
    _until(lambda: _kv(gw, "w1")["precise"], "w1 precise again")  # refilling: a block stored


def test_blocks_that_do_not_hash_as_expected_make_the_worker_approximate(
    stack: dict[str, Any],
) -> None:
    """The events' parentless chains are recomputed: a worker whose seed is not the configured
    one (here: its salt left out of the event) is routed approximately, and says why."""
    gw, pub = stack["gw"], stack["pubs"]["w1"]
    ids, hashes = _hashes("y")
    pub.publish(wire.BlockStored(hashes[:1], None, ids[:128], 128, medium="GPU"))
    _until(lambda: not _kv(gw, "w1")["precise"], "w1 approximate")
    assert "do not match" in _kv(gw, "w1")["reason"]


def _hello(pub: KvPublisher, gw: Proc) -> bool:
    if _kv(gw, "w1")["batches"]:
        return True
    pub.publish(wire.BlockRemoved([12345], "GPU"))
    time.sleep(0.2)
    return bool(_kv(gw, "w1")["batches"])


def _metric(gw: Proc, name: str) -> dict[str, float]:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}


def test_the_index_is_bounded_by_the_workers_own_blocks(stack: dict[str, Any]) -> None:
    """The fake shows 1000 blocks: storing more keeps the most recent 1000."""
    gw, pub = stack["gw"], stack["pubs"]["w2"]
    _worker_of(gw, _body())  # a precise request applies the worker's bound
    pub.publish(wire.BlockStored(list(range(10**6, 10**6 + 1500)), 1, [0] * 1500 * 128, 128,
                                 medium="GPU"))  # fmt: skip
    _until(lambda: _kv(gw, "w2")["evicted"] >= 500, "evicted")
    assert _kv(gw, "w2")["blocks"] == 1000


def test_a_worker_removed_by_a_reload_takes_its_kv_state_along(stack: dict[str, Any]) -> None:
    """A reload that removes a worker ends its KV-event subscription and drops its index and its
    series (a reload's ``_retire``); putting it back subscribes afresh."""
    gw = stack["gw"]
    path = next(stack["tmp"].glob("gpupool-*.yaml"))
    original = path.read_text()
    cfg = yaml.safe_load(original)
    cfg["workers"] = [w for w in cfg["workers"] if w["name"] != "w1"]
    path.write_text(yaml.safe_dump(cfg))
    try:
        r = httpx.post(gw.url + "/admin/reload", timeout=120)
        assert r.status_code == 200 and r.json()["workers"]["removed"] == ["w1"], r.text
        text = httpx.get(gw.url + "/metrics", timeout=10).text
        left = [line for line in text.splitlines()
                if line.startswith("gpupool_kv_") and 'worker="w1"' in line]  # fmt: skip
        assert not left, left
        assert any(line.startswith("gpupool_kv_indexed_blocks{") and 'worker="w2"' in line
                   for line in text.splitlines())  # fmt: skip
    finally:
        path.write_text(original)
        r = httpx.post(gw.url + "/admin/reload", timeout=120)
        assert r.status_code == 200, r.text
    # subscribed afresh: its first batch comes past what the replay keeps (a resync), and the
    # next block stored refills it
    ids, hashes = _hashes("z")
    block = wire.BlockStored(hashes[:1], None, ids[:128], 128, medium="GPU", extra_keys=[["z"]])

    def refilled() -> bool:
        stack["pubs"]["w1"].publish(block)
        time.sleep(0.2)
        return bool(_kv(gw, "w1")["precise"])

    _until(refilled, "w1 precise again")
