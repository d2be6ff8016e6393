"""Precise prefix routing on real vLLM (CPU) workers launched by `gpupool serve` (issue 34).

Two workers of the tiny dense model publish their KV-cache events (``routing.kv_events``) and
report ``prompt_tokens_details.cached_tokens``; each holds 48 blocks of 128 tokens, less than
the workload's tenants' prefixes together. The gateway's predicted cached tokens for every
precisely routed request are compared with vLLM's report in ``gpupool_kv_predictions_total``.

Gaps on real vLLM: a relay in the test forwards w1's events to `url:` workers a reload adds (w1's
own server, subscribed through the relay), and drops some on command; vLLM's own replay socket
fills the gap, or, for the one configured without it, the index is dropped and refills. The
sleep path cannot run here (the CPU build has no sleep mode): tests/workers/sim covers it.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
import zmq

from gpupool.workers.supervisor.command import kv_socket_dir
from tests.support.procs import Proc, free_port, gateway, running
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
            # a port from the tests' own lock (below the ephemeral range, held 300 s): a port
            # gpupool picks by bind(0) stays free only until vLLM binds it, 30 s and more later
            "port": free_port(),
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
    # The bar is 95 % exact, measured over runs (docs/benchmarks.md): 60/60 and
    # 57/60 at c5d9b97. Its misses are explained, not random noise in gpupool: with two requests
    # in flight on 48-block caches, one's allocation can evict the tail of the prefix the other
    # was predicted to find, just before vLLM schedules it (the KV events carry no reference
    # counts). At about 2.5 % misses, a 95 % assertion on 60 requests would fail about one run
    # in fifteen; at 90 % about one in a thousand, and it still catches a prediction that broke.
    assert delta.get("exact", 0) / total >= 0.90, delta
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
    _ask(gw, {"messages": [{"role": "user", "content": "hi"}]})  # precise (alone: -k fallback)
    _ask(gw, {"messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    modes = _metric(gw, "gpupool_kv_routed_requests_total")
    assert any("approximate: a message other than role and text content" in k for k in modes), modes
    assert any('mode="precise"' in k for k in modes), modes


class Relay(threading.Thread):
    """Forwards a PUB socket's messages to its own PUB, dropping them while ``dropping``."""

    def __init__(self, upstream: str, downstream: str) -> None:
        super().__init__(daemon=True)
        self.upstream, self.downstream = upstream, downstream
        self.dropping = threading.Event()
        self.forwarded = self.dropped = 0
        self._ready, self._halt = threading.Event(), threading.Event()

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.upstream)
            pub.bind(self.downstream)
            self._ready.set()
            while not self._halt.is_set():
                if not sub.poll(50):
                    continue
                frames = sub.recv_multipart()
                if self.dropping.is_set():
                    self.dropped += 1
                else:
                    pub.send_multipart(frames)
                    self.forwarded += 1
        finally:
            sub.close(0)
            pub.close(0)
            ctx.term()

    def __enter__(self) -> Relay:
        self.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(10)


def _until(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def _direct(url: str, text: str) -> None:
    """A request straight to vLLM (around the gateway): its blocks are published all the same."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def _reload(gw: Proc, cfg: dict[str, Any]) -> dict[str, Any]:
    path = Path(gw.argv[gw.argv.index("--config") + 1])
    path.write_text(yaml.safe_dump(cfg))
    r = httpx.post(gw.url + "/admin/reload", timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_gap_on_real_vllm_is_replayed_or_resynced(kv_stack: Proc) -> None:
    """w1's events reach three `url:` workers (w1's server) through a relay: one with vLLM's
    replay socket, one without, one with the wrong hash seed. Batches dropped on the way are a
    gap: replayed from vLLM for the first (its index equals w1's own), a resync for the second
    (dropped, then refilled by the next blocks), and the third is visibly approximate. A reload
    removing them takes their indexes and series along."""
    gw = kv_stack
    path = Path(gw.argv[gw.argv.index("--config") + 1])
    original = yaml.safe_load(path.read_text())
    state = Path(original["server"]["state_dir"])
    pub_path = next(kv_socket_dir(state).glob("w1-*.pub"))
    replay = f"ipc://{pub_path.with_suffix('.replay')}"
    relayed = f"ipc://{path.parent}/relay.pub"
    w1 = _workers(gw)["w1"]
    model_dir = next(w["launch"]["model_path"] for w in original["workers"] if w["name"] == "w1")

    def relay_worker(name: str, **kv: Any) -> dict[str, Any]:
        return {"name": name, "model": MODEL, "url": w1["url"], "max_inflight": 4,
                "kv_events": {"endpoint": relayed, "tokenizer": model_dir, **kv}}  # fmt: skip

    extra = [relay_worker("r-replay", replay_endpoint=replay, hash_seed="0"),
             relay_worker("r-none", hash_seed="0"),
             relay_worker("r-seed", replay_endpoint=replay, hash_seed="1")]  # fmt: skip
    names = [w["name"] for w in extra]
    rng = random.Random(71)
    with Relay(f"ipc://{pub_path}", relayed) as relay:
        try:
            added = _reload(gw, {**original, "workers": [*original["workers"], *extra]})
            assert added["workers"]["added"] == names, added
            _until(lambda: all(_workers(gw)[n]["state"] == "ready" for n in names), "ready")
            # the relayed workers hear w1 from here on, once their SUB sockets are connected: a
            # batch published before that is lost to them (ZeroMQ's late joiner) and only the
            # next one starts their catch-up, so w1 is asked again until r-replay has caught up
            # (at 1b125ee beside two burners one request's batches all came too early)
            for i in range(5):
                _direct(w1["url"], _prefix(rng, 300))
                try:
                    _until(lambda: _kv_of(gw, "r-replay")["blocks"]
                           == _kv_of(gw, "w1")["blocks"] > 0, "r-replay caught up", 20)  # fmt: skip
                    break
                except TimeoutError:
                    if i == 4:
                        raise
            before = {n: _kv_of(gw, n) for n in ("r-replay", "r-none")}
            relay.dropping.set()
            _direct(w1["url"], _prefix(rng, 300))  # its batches are lost on the way
            _until(lambda: relay.dropped > 0, "batches dropped")
            relay.dropping.clear()
            _direct(w1["url"], _prefix(rng, 300))  # the next batch shows the gap
            _until(lambda: _kv_of(gw, "r-replay")["replayed"] > before["r-replay"]["replayed"],
                   "r-replay replayed the gap")  # fmt: skip
            _until(lambda: _kv_of(gw, "r-replay")["blocks"] == _kv_of(gw, "w1")["blocks"],
                   "r-replay holds what w1 holds")  # fmt: skip
            _until(lambda: _kv_of(gw, "r-none")["resyncs"] > before["r-none"]["resyncs"],
                   "r-none resynced")  # fmt: skip
            none = _kv_of(gw, "r-none")
            assert none["gaps"] > before["r-none"]["gaps"], none
            assert 0 < none["blocks"] < _kv_of(gw, "w1")["blocks"], none  # refilled: after the gap
            # precise again once the gateway has read the added worker's /metrics (its cache
            # settings; run alone, this point came before the first scrape)
            _until(lambda: _kv_of(gw, "r-none")["precise"], "r-none routed precisely", 30)
            seed = _kv_of(gw, "r-seed")
            assert not seed["precise"] and "do not match" in seed["reason"], seed
        finally:
            _reload(gw, original)
    workers = _workers(gw)
    assert not set(names) & set(workers), workers
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    left = [line for line in text.splitlines()
            if line.startswith("gpupool_kv_") and any(f'"{n}"' in line for n in names)]  # fmt: skip
    assert not left, left


def _kv_of(gw: Proc, name: str) -> dict[str, Any]:
    return dict(httpx.get(f"{gw.url}/admin/workers/{name}", timeout=10).json()["kv"])


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
