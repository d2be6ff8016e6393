"""A broken or hostile worker cannot hurt the gateway or its clients (issue 26).

One raw-socket fake vLLM (``support/hostile_worker.py``) stays ready (health, models and metrics
answer normally) and misbehaves on generation, one mode per case. ``gpupool serve`` runs as a
process in front of it, once with the memory backend and once with Redis (admission and the
per-key limits through a real ``redis-server``), with short bounds and deadlines so every case
ends in about a second.

Each case asserts what its client gets (a 502 in the route's shape naming the bound, its
stream's error event, or the right answer), and, while it runs, ``/health`` answering within a
second and the gateway's resident memory growing by less than 100 MB (sampled from
``/proc/PID/status`` by a side thread); after it, nothing held (``assert_nothing_held``) and,
for a bound, the worker's failure counted and the gateway's log naming the worker and the bound.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import report
from tests.support.hostile_tools import assert_nothing_held
from tests.support.hostile_worker import HOSTILE_HEADERS, LONG_TEXT
from tests.support.procs import Proc, free_port, gateway, redis_server, running

MODEL, WINDOW, MAX_TOKENS = "m", 4096, 16
KEY, ADMIN = "sk-hostile-worker", "sk-hostile-admin"
AUTH = {"authorization": f"Bearer {KEY}"}
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
MB = 1 << 20
LIMITS = {
    "upstream_max_head_bytes": 16384,
    "upstream_max_headers": 100,
    "upstream_max_interim": 4,
    "upstream_max_body_bytes": 4 * MB,
    "upstream_max_event_bytes": 1 * MB,
    "upstream_total_timeout_s": 2.0,
    "upstream_read_timeout_s": 1.5,
}


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cfg(worker_url: str, redis_url: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "server": {"expose_worker_header": True, **LIMITS},
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": worker_url, "max_inflight": 4}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN), "keys": [
            {"name": "hw", "sha256": _h(KEY), "tpm": 1_000_000, "max_concurrent": 8}]},
        # a failing worker stays routable: every case here hits the same one
        "routing": {"health_interval_s": 0.5, "fail_threshold": 1_000_000},
    }  # fmt: skip
    if redis_url is not None:
        cfg["queue"] = {"backend": "redis", "redis_url": redis_url}
    return cfg


def hostile_worker(tmp: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.hostile_worker", "--port", str(port),
            "--model", MODEL, "--window", str(WINDOW)]  # fmt: skip
    return Proc(argv, f"http://127.0.0.1:{port}", tmp / f"hostile-worker-{port}.log")


@dataclass
class Pool:
    backend: str
    gw: Proc
    worker: Proc


@pytest.fixture(scope="module", params=["memory", "redis"])
def pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp(f"hostile-worker-{request.param}")
    w = hostile_worker(tmp)
    store = redis_server(tmp) if request.param == "redis" else None
    procs = [w] if store is None else [w, store]
    with running(*procs):
        g = gateway(_cfg(w.url, store.url if store else None), tmp)
        with running(g):
            deadline = time.monotonic() + 30
            while httpx.get(g.url + "/ready", headers=ADMIN_H).status_code != 200:
                assert time.monotonic() < deadline, "worker not ready"
                time.sleep(0.1)
            yield Pool(request.param, g, w)


# ---- the side thread: /health latency and the gateway's memory while a case runs ----------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@dataclass
class Watch:
    """``/health`` latencies and the gateway's RSS, sampled every 50 ms until ``stop``."""

    gw: Proc
    health_s: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                r = c.get(self.gw.url + "/health")
                self.health_s.append(time.monotonic() - t0)
                assert r.status_code == 200
                self.rss.append(rss_mb(self.gw.pid))
                self._stop.wait(0.05)


@pytest.fixture
def watch(pool: Pool, request: pytest.FixtureRequest) -> Iterator[Watch]:
    before = rss_mb(pool.gw.pid)
    w = Watch(pool.gw, rss=[before])
    thread = threading.Thread(target=w.run, daemon=True)
    thread.start()
    yield w
    wait_for(lambda: bool(w.health_s), "a /health sample")  # one at least, however quick the case
    w._stop.set()
    thread.join(15)
    assert_nothing_held(pool.gw.url, ADMIN_H)
    growth = max(w.rss) - before
    worst = max(w.health_s, default=0.0)
    report(f"hostile worker: {request.node.name}",
           health_max_ms=round(worst * 1000, 1), rss_growth_mb=round(growth, 1),
           rss_after_mb=round(rss_mb(pool.gw.pid), 1))  # fmt: skip
    assert worst < 1.0, f"/health took {worst:.2f} s while the case ran"
    assert growth < 100, f"the gateway grew by {growth:.0f} MB"


# ---- clients ------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[bytes]:
        """A stream's ``data:`` payloads."""
        return [ln[5:].strip() for ln in self.body.split(b"\n") if ln.startswith(b"data:")]


def ask(
    pool: Pool, mode: str, *, stream: bool = False, chat: bool = False, rid: str = ""
) -> Answer:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": mode}]
    else:
        body["prompt"] = mode
    headers = {**AUTH, "x-request-id": rid} if rid else AUTH
    with httpx.Client(timeout=30) as c, c.stream("POST", pool.gw.url + path, json=body,
                                                 headers=headers) as r:  # fmt: skip
        return Answer(r.status_code, r.headers, r.read())


def tokens(pool: Pool) -> tuple[float, float]:
    """The gateway's ``gpupool_tokens_total`` for worker w: (prompt, completion)."""
    text = httpx.get(pool.gw.url + "/metrics", headers=ADMIN_H, timeout=10).text
    out = {"prompt": 0.0, "completion": 0.0}
    for line in text.splitlines():
        m = re.match(r"gpupool_tokens_total\{(.*)\} (\S+)", line)
        if m and 'worker="w"' in m[1]:
            kind = re.search(r'kind="(\w+)"', m[1])
            if kind is not None:
                out[kind[1]] += float(m[2])
    return out["prompt"], out["completion"]


def last_error(pool: Pool) -> str:
    r = httpx.get(pool.gw.url + "/admin/workers/w", headers=ADMIN_H, timeout=10)
    return str(r.json().get("last_error"))


def assert_bound(pool: Pool, a: Answer, limit: str, says: str) -> None:
    """A 502 in the route's shape naming what the worker did, counted against the worker and
    logged with its name and the bound."""
    assert a.status == 502, a.body[:300]
    error = a.json()["error"]
    assert error["code"] == 502 and error["type"] == "BadGatewayError"
    assert says in error["message"], error["message"]
    assert "127.0.0.1" not in error["message"]  # never the worker's address
    assert limit in last_error(pool)
    wait_for(lambda: f"worker w crossed {limit}" in pool.gw.logs(), f"a log line for {limit}")


def assert_stream_error(a: Answer, says: str) -> None:
    """A stream that had begun ends with vLLM's in-stream error chunk and ``[DONE]``."""
    assert a.status == 200
    events = a.events()
    assert events[-1] == b"[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == 502 and says in error["message"], error


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


# ---- the cases: one per row of the table, and more ---------------------------------------

BOUNDS = [
    # mode, stream, the limit named, what the message says
    ("endless_head", False, "upstream_max_head_bytes", "response head over 16384 bytes"),
    ("huge_header", False, "upstream_max_head_bytes", "response head over 16384 bytes"),
    ("many_headers", False, "upstream_max_headers", "over 100 response headers"),
    ("endless_body", False, "upstream_max_body_bytes", "answer over 4194304 bytes"),
    ("trickle", False, "upstream_total_timeout_s", "no whole answer in 2 s"),
    ("early_hints", False, "upstream_max_interim", "over 4 1xx responses"),
    ("early_hints", True, "upstream_max_interim", "over 4 1xx responses"),
    ("gzip_body", False, "content-encoding", "`gzip`-encoded answer"),
    ("gzip_stream", True, "content-encoding", "`gzip`-encoded answer"),
    ("other_model", False, "model", "answered for another model"),
]


@pytest.mark.parametrize(("mode", "stream", "limit", "says"), BOUNDS,
                         ids=[f"{b[0]}{'-stream' if b[1] else ''}" for b in BOUNDS])  # fmt: skip
def test_a_worker_past_a_bound_gets_its_client_a_502(
    pool: Pool, watch: Watch, mode: str, stream: bool, limit: str, says: str
) -> None:
    assert_bound(pool, ask(pool, mode, stream=stream), limit, says)


STREAM_BOUNDS = [
    ("silent_stream", "upstream_read_timeout_s", "no a line of its stream in 1.5 s"),
    ("huge_line", "upstream_max_event_bytes", "SSE event over 1048576 bytes"),
    ("other_model", "model", "answered for another model"),
]


@pytest.mark.parametrize(
    ("mode", "limit", "says"), STREAM_BOUNDS, ids=[f"{b[0]}-stream" for b in STREAM_BOUNDS]
)
def test_a_stream_past_a_bound_ends_with_its_error_event(
    pool: Pool, watch: Watch, mode: str, limit: str, says: str
) -> None:
    """The stream had begun (a 200 went out): the bound ends it with the protocol's own error
    event; through the usage-stripping transform (the key has a tpm) for ``huge_line``."""
    assert_stream_error(ask(pool, mode, stream=True), says)
    assert limit in last_error(pool)
    wait_for(lambda: f"worker w crossed {limit}" in pool.gw.logs(), f"a log line for {limit}")


def test_surplus_bytes_after_content_length_leave_the_answer_whole(
    pool: Pool, watch: Watch
) -> None:
    """``Content-Length: 20``, more bytes and a second response: the 20 bytes, at once; the
    connection is never used again (a later request is answered rightly)."""
    a = ask(pool, "surplus")
    assert (a.status, a.body) == (200, b'{"id":"twenty-byte"}')
    assert ask(pool, "ok").json()["id"] == "cmpl-h"


def test_a_reply_to_a_request_not_sent_yet_is_never_an_answer(pool: Pool, watch: Watch) -> None:
    """After a good answer the worker writes another, unasked, on the idle kept-alive
    connection: the gateway drops that connection; the next request gets its own answer."""

    def sent() -> int:
        stats = httpx.get(pool.worker.url + "/stats", timeout=10).json()
        return int(stats["modes"].get("early_reply.sent", 0))

    before = sent()
    first = ask(pool, "early_reply")
    assert first.status == 200 and first.json()["id"] == "cmpl-h"
    # the worker wrote the unasked reply (an event: its 0.05 s pause may last longer under load)
    wait_for(lambda: sent() > before, "the unasked reply sent", timeout=15)
    time.sleep(0.2)  # and the gateway's loop has read it off the idle connection
    for _ in range(3):
        a = ask(pool, "ok")
        assert a.status == 200 and a.json()["id"] == "cmpl-h", a.body


def test_a_worker_never_sets_a_clients_headers(pool: Pool, watch: Watch) -> None:
    """Cookies, CORS, redirects, auth challenges, HSTS, Alt-Svc, an internal address, a
    worker's x-request-id and x-gpupool-*: none reaches the client; the gateway's own
    headers are the gateway's, once each."""
    a = ask(pool, "header_zoo", rid="client-rid-1")
    assert a.status == 200 and a.json()["id"] == "cmpl-h"
    names = [k.lower() for k, _ in a.headers.multi_items()]
    for name, _ in HOSTILE_HEADERS:
        if name not in ("x-request-id", "x-gpupool-worker"):
            assert name not in names, name
    assert a.headers.get_list("x-request-id") == ["client-rid-1"]
    assert a.headers.get_list("x-gpupool-worker") == ["w"]
    assert "not-the-worker" not in str(a.headers) and "10.1.2.3" not in str(a.headers)


def test_usage_of_ten_to_the_thirty_is_clamped(pool: Pool, watch: Watch) -> None:
    """A usage of 10^30 tokens charges the prompt's window and the request's max_tokens, no
    more: the key's budget stays exact and its next request is admitted."""
    before = tokens(pool)
    assert ask(pool, "huge_usage").status == 200
    wait_for(lambda: tokens(pool) != before, "the usage counted")
    after = tokens(pool)
    assert (after[0] - before[0], after[1] - before[1]) == (WINDOW, MAX_TOKENS)
    assert ask(pool, "ok").status == 200  # the key is not locked out, no 500


def test_usage_that_is_no_count_is_not_charged(pool: Pool, watch: Watch) -> None:
    """Floats, negatives and strings are no token counts: nothing is read (the reservation
    stands for the key), nothing breaks."""
    before = tokens(pool)
    assert ask(pool, "float_usage").status == 200
    assert ask(pool, "ok").status == 200
    wait_for(lambda: tokens(pool)[1] == before[1] + 1, "the next request's usage")
    assert tokens(pool) == (before[0] + 3, before[1] + 1)  # the good one's only


def test_usage_written_with_spaces_is_read_as_json_is(pool: Pool, watch: Watch) -> None:
    before = tokens(pool)
    assert ask(pool, "spaced_usage").status == 200
    wait_for(lambda: tokens(pool) != before, "the usage counted")
    after = tokens(pool)
    assert (after[0] - before[0], after[1] - before[1]) == (5, 7)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_event_split_across_every_byte_arrives_whole(
    pool: Pool, watch: Watch, chat: bool
) -> None:
    before = tokens(pool)
    a = ask(pool, "split_bytes", stream=True, chat=chat)
    assert a.status == 200
    events = a.events()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)  # the usage chunk the gateway asked for: dropped
    if chat:
        texts = [c["choices"][0]["delta"]["content"] for c in chunks]
    else:
        texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == ["t0", "t1", "t2"]
    wait_for(lambda: tokens(pool)[1] == before[1] + 3, "the stream's usage, read across bytes")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_long_event_in_many_reads_arrives_whole(pool: Pool, watch: Watch, chat: bool) -> None:
    """768 KiB in one event, 1 KiB a write, through the usage-stripping reshape (the key has a
    tpm): the client gets it whole and its usage is counted (the relay searches each byte
    for the event's end once, ``transform/sse.py``)."""
    before = tokens(pool)
    a = ask(pool, "long_event", stream=True, chat=chat)
    assert a.status == 200
    events = a.events()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if chat:
        texts = [c["choices"][0]["delta"]["content"] for c in chunks]
    else:
        texts = [c["choices"][0]["text"] for c in chunks]
    assert texts == [LONG_TEXT, "t1", "t2"]
    wait_for(lambda: tokens(pool)[1] == before[1] + 3, "the stream's usage")


def test_done_in_the_middle_of_a_json_object_ends_the_stream(pool: Pool, watch: Watch) -> None:
    a = ask(pool, "done_mid_json", stream=True)
    assert a.status == 200 and a.events()[-1] == b"[DONE]"


def test_a_stream_that_never_sends_done_ends_with_an_error_event(pool: Pool, watch: Watch) -> None:
    assert_stream_error(ask(pool, "no_done", stream=True), "ended the stream early")


def test_a_good_worker_still_answers(pool: Pool, watch: Watch) -> None:
    """After every case: the same worker, answered normally, both ways."""
    assert ask(pool, "ok").status == 200
    a = ask(pool, "ok", stream=True, chat=True)
    assert a.status == 200 and a.events()[-1] == b"[DONE]"
