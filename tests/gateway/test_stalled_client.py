"""A client that stops reading, or trickles, is cut after ``server.write_timeout_s`` (``stall.py``).

Found by review: a client that opens a stream (or a large whole reply) and then never reads,
without closing its socket, blocked the gateway's writes forever, and with them the request's
worker slot, its key's concurrency slot and the worker's capacity. Here a real `gpupool serve`
(``write_timeout_s`` 1 s) sits in front of the simulator, whose script is 16 KiB runs of spaces
(one token each, so a stream fills the socket buffers in a second), and of a stand-in worker
whose ``/v1/responses`` and ``/v1/messages`` streams never end (the simulator streams neither).
Clients are raw sockets with a small receive buffer that send one request and never read.

Every case waits on conditions with generous deadlines (no timing assertions) and ends with
nothing held: slots, in-flight counts and the key's concurrency slots all back to zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gpupool.config.models import ServerConfig
from tests.support.hostile_tools import Recorder, assert_nothing_held, held
from tests.support.procs import Proc, gateway, running, sim

pytestmark = pytest.mark.timing  # a reader is judged by bytes per write_timeout_s

MODEL, OTHER = "m", "a"  # the simulator's model; the stand-in's (responses and messages)
KEY, ADMIN = "sk-stall-key", "sk-stall-admin"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
WRITE_TIMEOUT_S = 1.0
# a gateway of its own for readers that must never be cut: a test process descheduled for a
# second on a loaded machine would look stalled to a 1 s bound, not to this one
STEADY_TIMEOUT_S = 10.0
STEADY_MIN_BYTES = 128 * 1024  # per 10 s: 13 KB/s, 30 times under the slow reader's pace
RUN = 16 * 1024  # spaces in one of the script's tokens
DEADLINE_S = 60.0


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class EndlessStreams(Recorder):
    """A worker stand-in whose ``/v1/responses`` and ``/v1/messages`` streams (the simulator
    streams neither) go on until the gateway hangs up, counted in ``hung_up``; everything else
    as :class:`Recorder` answers it."""

    def __init__(self, model: str) -> None:
        super().__init__(model=model)
        self.hung_up = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in _EVENTS:
            await self._endless(_EVENTS[scope["path"]], receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def _endless(self, events: tuple[bytes, bytes], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        await send({"type": "http.response.body", "body": events[0], "more_body": True})
        while not gone.is_set():
            await send({"type": "http.response.body", "body": events[1], "more_body": True})
            await asyncio.sleep(0.004)
        watcher.cancel()
        self.hung_up += 1


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


_RUN = " " * RUN
_EVENTS = {  # path: (its first event, the one repeated)
    "/v1/responses": (
        _event("response.created", {"type": "response.created",
                                    "response": {"id": "resp", "model": OTHER}}),
        _event("response.output_text.delta", {"type": "response.output_text.delta",
                                              "item_id": "msg", "delta": _RUN}),
    ),
    "/v1/messages": (
        _event("message_start", {"type": "message_start",
                                 "message": {"id": "msg", "model": OTHER}}),
        _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "text_delta", "text": _RUN}}),
    ),
}  # fmt: skip


@dataclass
class Pool:
    gw: Proc
    worker: str
    streams: EndlessStreams
    tmp: Path


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("stalled")
    script = tmp / "script.txt"
    script.write_text(("x" + " " * RUN) * 1500)  # 3000 tokens, 24 MiB
    w = sim(model=MODEL, tmp=tmp, max_num_seqs=16, itl_ms=2, script_file=str(script),
            max_model_len=8192)  # fmt: skip
    endless = EndlessStreams(OTHER)
    server = {"write_timeout_s": WRITE_TIMEOUT_S}
    with endless.running(), running(w), _gateway(tmp, w.url, endless.url, server) as g:
        yield Pool(g, w.url, endless, tmp)


@pytest.fixture(scope="module")
def steady(pool: Pool) -> Iterator[Proc]:
    """A gateway before the same workers whose bound no scheduling delay reaches."""
    tmp = pool.tmp / "steady"
    tmp.mkdir()
    server = {"write_timeout_s": STEADY_TIMEOUT_S, "write_min_bytes": STEADY_MIN_BYTES}
    with _gateway(tmp, pool.worker, pool.streams.url, server) as g:
        yield g


@contextmanager
def _gateway(tmp: Path, worker: str, endless: str, server: dict[str, Any]) -> Iterator[Proc]:
    cfg = {
        "server": server,
        "models": [{"name": MODEL}, {"name": OTHER}],
        "workers": [{"name": "w", "model": MODEL, "url": worker, "max_inflight": 8},
                    {"name": "e", "model": OTHER, "url": endless, "max_inflight": 4}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "stall", "sha256": _h(KEY), "max_concurrent": 4}]},
        "routing": {"health_interval_s": 0.5},
    }  # fmt: skip
    g = gateway(cfg, tmp)
    with running(g):
        _wait(lambda: httpx.get(g.url + "/ready", headers=ADMIN_H).status_code == 200,
              "workers ready")  # fmt: skip
        yield g


def _wait(cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def _stats(worker: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(worker + "/sim/stats", timeout=10).json()
    return data


def _cancelled(gw: str) -> float:
    """``gpupool_requests_total{status="cancelled"}``: the requests whose clients left."""
    text = httpx.get(gw + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("gpupool_requests_total{")]
    return sum(float(line.rpartition(" ")[2]) for line in lines if 'status="cancelled"' in line)


def _request(path: str, body: dict[str, Any], rid: str) -> bytes:
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
            f"x-request-id: {rid}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n")  # fmt: skip
    return head.encode() + raw


def _client(gw: str, rcvbuf: int | None = 4096) -> socket.socket:
    host, port = gw.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    return s


def _cut(s: socket.socket) -> bool:
    """Read what the socket still holds: the gateway reset it (or closed it) before the end
    of the reply (a socket still open fails on the deadline)."""
    s.settimeout(DEADLINE_S)
    tail = b""
    try:
        while data := s.recv(1 << 16):
            tail = (tail + data)[-16:]
    except ConnectionResetError:
        return True
    return not tail.endswith(b"0\r\n\r\n")


def _logged(gw: Proc, *parts: str) -> bool:
    return any(all(p in line for p in parts) for line in gw.log_path.read_text().splitlines())


def _stream_body(route: str, tokens: int) -> tuple[str, dict[str, Any]]:
    if route == "chat":
        msgs = [{"role": "user", "content": "hi"}]
        return "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": tokens,
                                        "stream": True}  # fmt: skip
    if route == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": tokens,
                                   "stream": True}  # fmt: skip
    if route == "responses":
        return "/v1/responses", {"model": OTHER, "input": "hi", "max_output_tokens": tokens,
                                 "stream": True}  # fmt: skip
    assert route == "messages"
    msgs = [{"role": "user", "content": "hi"}]
    return "/v1/messages", {"model": OTHER, "messages": msgs, "max_tokens": tokens,
                            "stream": True}  # fmt: skip


def _answered(gw: str) -> None:
    """Another client is served as usual."""
    r = httpx.post(gw + "/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "z", "max_tokens": 3}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def _aborted(pool: Pool, route: str) -> int:
    if route in ("responses", "messages"):
        return pool.streams.hung_up
    return int(_stats(pool.worker)["aborted_total"])


# ---- a stream the client stops reading ---------------------------------------------------------


@pytest.mark.parametrize("via", ["lane", "asgi"])  # asgi: a query string takes uvicorn's way
@pytest.mark.parametrize("route", ["chat", "completions", "responses", "messages"])
def test_a_stream_its_client_stops_reading_is_cut_and_gives_back_everything(
    pool: Pool, route: str, via: str
) -> None:
    gw, rid = pool.gw, f"stall-{route}-{via}"
    path, body = _stream_body(route, 3000)
    path += "?via=asgi" if via == "asgi" else ""
    aborted, cancelled = _aborted(pool, route), _cancelled(gw.url)
    s = _client(gw.url)
    try:
        s.sendall(_request(path, body, rid))  # ... and never read
        _wait(lambda: sum(held(gw.url, ADMIN_H)["key_slots"].values()) == 1
              or _logged(gw, rid, "write_timeout_s"), "the request admitted")  # fmt: skip
        _answered(gw.url)  # others are served meanwhile
        _wait(lambda: _logged(gw, f"client={rid}]", "server.write_timeout_s"), "the cut logged")
        assert_nothing_held(gw.url, ADMIN_H, within_s=DEADLINE_S)
        _wait(lambda: _aborted(pool, route) > aborted, "the worker's request aborted")
        _wait(lambda: _cancelled(gw.url) > cancelled, "counted as a client that left")
        assert _cut(s)
    finally:
        s.close()
    _answered(gw.url)
    assert_nothing_held(gw.url, ADMIN_H)


def test_a_slow_but_steady_reader_is_not_cut(steady: Proc) -> None:
    """A client reading ten times slower than the stream comes (its buffers full, the gateway's
    writes paused for longer than ``write_timeout_s`` in all), but some 30 times faster than
    ``write_min_bytes`` asks, gets all of it."""
    gw, rid = steady, "slow-reader"
    path, body = _stream_body("completions", 600)  # 300 runs of 16 KiB: 4.9 MB
    s = _client(gw.url, rcvbuf=None)
    got = bytearray()
    try:
        s.sendall(_request(path, body, rid))
        s.settimeout(DEADLINE_S)
        while not got.endswith(b"0\r\n\r\n"):
            data = s.recv(16384)
            assert data, "the gateway closed the stream"
            got += data
            time.sleep(0.04)  # at most 400 KB/s
    finally:
        s.close()
    events = _dechunk(bytes(got))
    assert events.endswith(b"data: [DONE]\n\n")
    assert events.count(b" " * RUN) == 300  # every run came, nothing cut
    assert not _logged(gw, rid, "write_timeout_s")
    assert_nothing_held(gw.url, ADMIN_H)


def test_a_trickling_reader_is_cut_and_gives_back_everything(pool: Pool, steady: Proc) -> None:
    """Found by review: a client that takes a little now and then (progress, so no stall) held
    its worker slot and key slot for hours. Here it reads 512 bytes every quarter second, at
    most 20 KB per ``write_timeout_s`` (a loaded machine only makes it slower), against a
    minimum of 128 KiB: it is cut and gives everything back."""
    gw, rid = steady, "trickle"
    # the stand-in's endless stream: a simulator's would end on its own within the window
    path, body = _stream_body("responses", 3000)
    aborted, cancelled = _aborted(pool, "responses"), _cancelled(gw.url)
    s = _client(gw.url)
    s.settimeout(DEADLINE_S)
    got, deadline = 0, time.monotonic() + DEADLINE_S
    try:
        s.sendall(_request(path, body, rid))
        while not _logged(gw, f"client={rid}]", "server.write_timeout_s"):
            assert time.monotonic() < deadline, "the trickling reader never cut"
            try:
                data = s.recv(512)
            except ConnectionResetError:
                break
            assert data, "the gateway closed the stream without a reset"
            got += len(data)
            time.sleep(0.25)
        assert got > 0  # it did read: a stall by takes-nothing alone would not catch it
        _wait(lambda: _logged(gw, f"client={rid}]", "server.write_min_bytes"), "the cut logged")
        assert_nothing_held(gw.url, ADMIN_H, within_s=DEADLINE_S)
        _wait(lambda: _aborted(pool, "responses") > aborted, "the worker's request closed")
        _wait(lambda: _cancelled(gw.url) > cancelled, "counted as a client that left")
        assert _cut(s)
    finally:
        s.close()
    _answered(gw.url)
    assert_nothing_held(gw.url, ADMIN_H)


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    body, at = bytearray(), raw.index(b"\r\n\r\n") + 4
    while True:
        end = raw.index(b"\r\n", at)
        size = int(raw[at:end], 16)
        if size == 0:
            return bytes(body)
        body += raw[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


# ---- whole replies -------------------------------------------------------------------------------


def test_an_unread_whole_reply_holds_nothing_and_its_connection_is_cut(pool: Pool) -> None:
    """A whole reply is written at once: its slots are back as soon as it is; the connection
    holding it unread is reset after the bound (its buffer freed)."""
    gw = pool.gw
    before = _stats(pool.worker)["completed_total"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 800}  # 6.5 MB of JSON
    s = _client(gw.url)
    try:
        s.sendall(_request("/v1/completions", body, "whole-unread"))
        _wait(lambda: _stats(pool.worker)["completed_total"] > before, "the worker answered")
        assert_nothing_held(gw.url, ADMIN_H, within_s=DEADLINE_S)
        port = s.getsockname()[1]
        _wait(lambda: _logged(gw, f"cut a connection from 127.0.0.1:{port}", "write_timeout_s"),
              "the connection cut")  # fmt: skip
        assert _cut(s)
    finally:
        s.close()
    _answered(gw.url)


@pytest.mark.parametrize("via", ["lane", "asgi"])
def test_a_request_pipelined_behind_an_unread_reply_is_cut_and_gives_back_everything(
    pool: Pool, via: str
) -> None:
    """A 6.5 MB whole reply the client never reads, and a stream pipelined behind it: the
    stream's writes wait from its first byte; it is cut and gives everything back."""
    gw, rid = pool.gw, f"pipelined-{via}"
    query = "?via=asgi" if via == "asgi" else ""
    big = {"model": MODEL, "prompt": "hi", "max_tokens": 800}
    path, stream = _stream_body("chat", 3000)
    s = _client(gw.url)
    try:
        s.sendall(_request("/v1/completions" + query, big, rid + "-big")
                  + _request(path + query, stream, rid))  # fmt: skip
        _wait(lambda: _logged(gw, f"client={rid}]", "server.write_timeout_s"), "the cut logged")
        assert_nothing_held(gw.url, ADMIN_H, within_s=DEADLINE_S)
        assert _cut(s)
    finally:
        s.close()
    _answered(gw.url)
    assert_nothing_held(gw.url, ADMIN_H)


def test_the_settings_have_serious_defaults_and_no_zero() -> None:
    assert 30.0 <= ServerConfig().write_timeout_s <= 60.0
    # a minimum rate of ~270 B/s: no real reader is that slow, a trickle of segments is
    assert 4 * 1024 <= ServerConfig().write_min_bytes <= 64 * 1024
    with pytest.raises(ValidationError, match="write_timeout_s"):
        ServerConfig(write_timeout_s=0)
    with pytest.raises(ValidationError, match="write_min_bytes"):
        ServerConfig(write_min_bytes=0)
