"""Hostile clients through a real `gpupool serve` process, each case ending with nothing held.

Every case is a class of failure found on the previous main (issue 11): slots leaked by a
client that resets while the gateway is blocked writing, routes that skipped the guards, a body
within the limits that froze the event loop, limits with holes, bad headers answered with 500.
After each, :func:`assert_nothing_held` checks in-flight counts, admission slots, the queue and
per-key slots are back to zero within a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import report
from tests.support.hostile_tools import Recorder, assert_nothing_held, held
from tests.support.procs import gateway, running, sim

MODEL, OTHER = "m", "other"
ADMIN, PAIR, ONLY, TPM = "sk-admin-h", "sk-pair-h", "sk-only-h", "sk-tpm-h"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _auth() -> dict[str, Any]:
    return {
        "enabled": True,
        "admin_key_sha256": _h(ADMIN),
        "keys": [
            {"name": "pair", "sha256": _h(PAIR), "max_concurrent": 2},
            {"name": "only", "sha256": _h(ONLY), "models": [OTHER], "priority_min": 0,
             "priority_max": 5},
            {"name": "tpm", "sha256": _h(TPM), "tpm": 60},
        ],
    }  # fmt: skip


def _cfg(worker_url: str, other_url: str, capacity: int = 4) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "remote_media": "allow", "limits": {"image": 4}},
                   {"name": OTHER}],
        "workers": [{"name": "w", "model": MODEL, "url": worker_url, "max_inflight": capacity},
                    {"name": "o", "model": OTHER, "url": other_url, "max_inflight": 4}],
        "auth": _auth(),
        "routing": {"health_interval_s": 0.5},
    }  # fmt: skip


@dataclass
class Pool:
    gw: str
    worker: str
    recorder: Recorder


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("hostile")
    w = sim(model=MODEL, tmp=tmp, max_num_seqs=64, ttft_ms=300, itl_ms=5)
    rec = Recorder(model=OTHER)
    with rec.running(), running(w):
        g = gateway(_cfg(w.url, rec.url), tmp)
        with running(g):
            deadline = time.monotonic() + 30
            while httpx.get(g.url + "/ready", headers=ADMIN_H).status_code != 200:
                assert time.monotonic() < deadline, "workers not ready"
                time.sleep(0.1)
            yield Pool(g.url, w.url, rec)


_COUNTED = ("/v1/", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank")


@pytest.fixture(autouse=True)
def tally(pool: Pool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        list[str]]:  # fmt: skip
    """What every client of the case saw (HTTP status, ``left``, ``conn-error``), reported with
    what stayed held once it ended: ``FAULT-RESULT`` lines (and ``GPUPOOL_FAULT_RESULTS``)."""
    seen: list[str] = []
    port = pool.gw.rsplit(":", 1)[1]
    send, asend = httpx.Client.send, httpx.AsyncClient.send

    def counted(req: httpx.Request) -> bool:
        return str(req.url.port) == port and req.url.path.startswith(_COUNTED)

    def sync_send(self: httpx.Client, request: httpx.Request, **kw: Any) -> httpx.Response:
        req = request
        try:
            r = send(self, req, **kw)
        except httpx.HTTPError:
            seen.extend(["conn-error"] if counted(req) else [])
            raise
        seen.extend([str(r.status_code)] if counted(req) else [])
        return r

    async def async_send(
        self: httpx.AsyncClient, request: httpx.Request, **kw: Any
    ) -> httpx.Response:
        req = request
        try:
            r = await asend(self, req, **kw)
        except (httpx.HTTPError, asyncio.CancelledError) as e:
            if counted(req):
                seen.append("left" if isinstance(e, asyncio.CancelledError) else "conn-error")
            raise
        seen.extend([str(r.status_code)] if counted(req) else [])
        return r

    monkeypatch.setattr(httpx.Client, "send", sync_send)
    monkeypatch.setattr(httpx.AsyncClient, "send", async_send)
    yield seen
    monkeypatch.undo()
    snapshot = held(pool.gw, ADMIN_H)
    leaked = sum(int(v) for part in snapshot.values() for v in part.values())
    by_status = dict(sorted(Counter(seen).items()))
    report(f"hostile: {request.node.name}", sent=len(seen), by_status=by_status, leaked=leaked,
           five_xx=sum(n for k, n in by_status.items() if k.startswith("5")))  # fmt: skip


def _key(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _stats(worker: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(worker + "/sim/stats", timeout=10).json()
    return data


# ---- 1. leaked slots ------------------------------------------------------------------------


def _http_request(path: str, body: dict[str, Any], key: str) -> bytes:
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n")  # fmt: skip
    return head.encode() + raw


def _pipeline_and_reset(gw: str, key: str) -> None:
    """A large whole reply the client never reads, a stream pipelined behind it, a reset."""
    host, port = gw.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the gateway blocks writing soon
    s.connect((host, int(port)))
    big = {"model": OTHER, "prompt": "big", "max_tokens": 4}  # a 16 MiB answer, at once
    stream = {"model": OTHER, "prompt": "y", "max_tokens": 50, "stream": True}
    s.sendall(_http_request("/v1/completions", big, key) + _http_request(
        "/v1/completions", stream, key))  # fmt: skip
    time.sleep(1.5)  # the big reply fills the buffers; the stream's head blocks behind it
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # RST


def test_client_that_resets_while_the_gateway_is_blocked_writing_leaks_nothing(
    pool: Pool, tally: list[str]
) -> None:
    gw = pool.gw
    for _ in range(3):
        _pipeline_and_reset(gw, PAIR)
        tally += ["left", "left"]  # two pipelined requests, then a reset
    assert_nothing_held(gw, ADMIN_H, within_s=3.0)
    # The key (max_concurrent 2) and the model still work.
    r = httpx.post(gw + "/v1/completions", headers=_key(PAIR), timeout=30,
                   json={"model": MODEL, "prompt": "z", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200
    assert_nothing_held(gw, ADMIN_H)


def test_client_that_leaves_while_queued_or_mid_stream_leaks_nothing(
    pool: Pool,
) -> None:
    gw = pool.gw
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:

            async def leave_after(delay: float) -> None:
                req = client.post(gw + "/v1/completions", json=body, headers=_key(ADMIN))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(req, delay)

            # 12 on a worker of capacity 4: some leave queued, some mid-stream, some early.
            await asyncio.gather(*(leave_after(0.05 + 0.1 * i) for i in range(12)))

    asyncio.run(scenario())
    assert_nothing_held(gw, ADMIN_H, within_s=2.0)


# ---- 2. every token-bearing route is guarded ------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/iam",
        "file:///etc/shadow",
        "http://127.0.0.1:6379/",
        "http://[::1]/x.png",
    ],
)
def test_responses_media_goes_through_the_media_policy(pool: Pool, url: str) -> None:
    gw, worker = pool.gw, pool.worker
    before = len(_stats(worker)["request_ids"])
    item = {"role": "user", "content": [{"type": "input_text", "text": "what is this"},
                                        {"type": "input_image", "image_url": url}]}  # fmt: skip
    r = httpx.post(gw + "/v1/responses", headers=_key(ADMIN), timeout=30,
                   json={"model": MODEL, "input": [item]})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    assert len(_stats(worker)["request_ids"]) == before  # the worker never saw it
    assert_nothing_held(gw, ADMIN_H)


def test_responses_are_admitted_like_chat(pool: Pool) -> None:
    """20 concurrent /v1/responses on a worker of capacity 4: at most 4 reach it at once."""
    gw, worker = pool.gw, pool.worker
    httpx.post(worker + "/sim/reset", timeout=10)
    peak: list[int] = []

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:

            async def one(i: int) -> int:
                r = await client.post(gw + "/v1/responses", headers=_key(ADMIN),
                                      json={"model": MODEL, "input": f"q{i}",
                                            "max_output_tokens": 8})  # fmt: skip
                return r.status_code

            async def watch() -> None:
                for _ in range(20):
                    peak.append(sum(held(gw, ADMIN_H)["inflight"].values()))
                    await asyncio.sleep(0.05)

            results = await asyncio.gather(*(one(i) for i in range(20)), watch())
            return [s for s in results if s is not None]

    statuses = asyncio.run(scenario())
    assert statuses == [200] * 20
    assert _stats(worker)["peak_running"] <= 4
    assert max(peak) > 0  # the gateway counted them (previously: 0 in flight)
    assert_nothing_held(gw, ADMIN_H)


def test_tokenize_and_embeddings_are_authorised_per_model(pool: Pool) -> None:
    gw = pool.gw
    for path, body in (("/tokenize", {"model": MODEL, "prompt": "hi"}),
                       ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
                       ("/v1/messages", {"model": MODEL, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip  # noqa: E501
        r = httpx.post(gw + path, headers=_key(ONLY), json=body, timeout=30)
        assert r.status_code == 403, (path, r.text)
    assert_nothing_held(gw, ADMIN_H)


# ---- 4. limits with holes -------------------------------------------------------------------


def test_a_key_sees_only_its_models(pool: Pool) -> None:
    gw = pool.gw
    ids = [m["id"] for m in httpx.get(gw + "/v1/models", headers=_key(ONLY)).json()["data"]]
    assert ids == [OTHER]
    r = httpx.post(gw + "/v1/completions", headers=_key(ONLY), timeout=30,
                   json={"model": "nope", "prompt": "x"})  # fmt: skip
    assert r.status_code == 404
    assert MODEL + "," not in r.json()["error"]["message"]
    assert f"`{MODEL}`" not in r.json()["error"]["message"]
    assert sorted(m["id"] for m in httpx.get(gw + "/v1/models", headers=ADMIN_H).json()["data"]
                  ) == [MODEL, OTHER]  # fmt: skip


def test_sequences_are_capped_n_times_prompts(pool: Pool) -> None:
    gw, worker = pool.gw, pool.worker
    before = len(_stats(worker)["request_ids"])
    r = httpx.post(gw + "/v1/completions", headers=_key(ADMIN), timeout=30,
                   json={"model": MODEL, "prompt": ["x"] * 5000, "n": 16,
                         "max_tokens": 1})  # fmt: skip
    assert r.status_code == 400
    assert "server.max_sequences" in r.json()["error"]["message"]
    assert len(_stats(worker)["request_ids"]) == before


def test_priority_is_clamped_in_the_forwarded_body(pool: Pool) -> None:
    gw = pool.gw
    r = httpx.post(gw + "/v1/completions", headers=_key(ONLY), timeout=30,
                   json={"model": OTHER, "prompt": "x", "max_tokens": 1,
                         "priority": -10**9})  # fmt: skip
    assert r.status_code == 200, r.text
    path, body = pool.recorder.bodies[-1]
    assert path == "/v1/completions" and body["priority"] == 0  # the key's priority_min


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e309", "abc", "1.5", "9" * 40])
def test_bad_priority_header_is_400_not_500(pool: Pool, value: str) -> None:
    gw = pool.gw
    r = httpx.post(gw + "/v1/completions", headers={**_key(ADMIN), "x-gpupool-priority": value},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)  # fmt: skip
    assert r.status_code == 400, r.text
    assert "x-gpupool-priority" in r.json()["error"]["message"]


@pytest.mark.parametrize("header", ["x-gpupool-max-wait", "x-gpupool-queue-events"])
def test_other_gateway_headers_are_validated(pool: Pool, header: str) -> None:
    gw = pool.gw
    r = httpx.post(gw + "/v1/completions", headers={**_key(ADMIN), header: "nan"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and header in r.json()["error"]["message"]


def test_streams_without_include_usage_are_charged_to_the_token_budget(
    pool: Pool,
) -> None:
    """The gateway asks the worker for usage, charges it, and strips the chunk the client did
    not ask for; the budget (60 tokens a minute) is then spent."""
    gw = pool.gw
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True}
    with httpx.stream("POST", gw + "/v1/completions", headers=_key(TPM), json=body,
                      timeout=30) as r:  # fmt: skip
        raw = b"".join(r.iter_raw())
    assert r.status_code == 200
    assert b'"usage"' not in raw.replace(b'"usage":null', b"")  # not asked for: not shown
    assert raw.rstrip().endswith(b"data: [DONE]")
    statuses = []
    for _ in range(3):
        with httpx.stream("POST", gw + "/v1/completions", headers=_key(TPM), json=body,
                          timeout=30) as r:  # fmt: skip
            statuses.append(r.status_code)
            r.read()
    assert 429 in statuses
    assert_nothing_held(gw, ADMIN_H)


# ---- 3. bounded parsing cost ----------------------------------------------------------------


def _nested(arrays: int, depth: int) -> bytes:
    inner = "1"
    for _ in range(depth - 1):
        inner = "[" + inner + "]"
    content = "[" + ",".join([inner] * arrays) + "]"
    return ('{"model":"m","messages":[{"role":"user","content":' + content + "}]}").encode()


def test_the_worst_body_the_limits_allow_does_not_stall_health(pool: Pool) -> None:
    """60-deep arrays up to the container limit (200,000): answered, and /health keeps
    answering meanwhile. Over the limit (the 7 MiB body of 3.6 million arrays): a quick 400."""
    gw = pool.gw
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t = time.perf_counter()
                c.get(gw + "/health")
                latencies.append(time.perf_counter() - t)

    worst_allowed = _nested(200_000 // 60 - 10, 60)
    too_many = _nested(60_000, 60)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        headers = {**_key(ADMIN), "content-type": "application/json"}
        url = gw + "/v1/chat/completions"
        r1 = httpx.post(url, headers=headers, content=worst_allowed, timeout=60)
        r2 = httpx.post(url, headers=headers, content=too_many, timeout=60)
    finally:
        done.set()
        poller.join()
    assert r1.status_code < 500 and r2.status_code == 400, (r1.text[:200], r2.text[:200])
    assert "max_json_containers" in r2.json()["error"]["message"]
    assert latencies  # /health answered while the bodies were parsed
    print(f"worst /health latency under the worst bodies: {max(latencies) * 1000:.1f} ms")
    assert_nothing_held(gw, ADMIN_H)
