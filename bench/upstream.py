"""A vLLM-shaped upstream that answers from precomputed bytes: the rig's zero-latency worker.

    .venv/bin/python bench/upstream.py --port 9100 [--pace-ms 20] [--idle-s 20]

The simulator (``gpupool sim --ttft-ms 0 --itl-ms 0``) is a FastAPI app and becomes the bottleneck
long before the Rust routers do; this server is uvloop + httptools with every response built once
at start-up, so the rig's own cost per request is a few microseconds.

The request's ``model`` picks the behaviour (every gateway under test forwards it):

* ``fast``   JSON, or SSE with 64 chunks written at once (zero delay: overhead measurements);
* ``paced``  SSE, 64 chunks one every ``--pace-ms`` (streaming TTFT and inter-chunk gaps), each
  stamped with the moment it left (``@<perf_counter>`` in its content) so that the client can
  tell the delivery delay of every chunk from the upstream's own timer jitter;
* ``idle``   SSE, first chunk at once, then one every ``--idle-s`` (idle-stream memory).

Also ``GET /health``, ``/v1/models`` (all three, ``max_model_len`` 32768), ``/metrics`` (vLLM's
gauges at zero, its ``cache_config_info``), ``/version``, ``/get_server_info`` and
``/get_model_info`` for the routers' probes.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import time
from typing import cast

import httptools
import orjson
import uvloop

MODELS = ("fast", "paced", "idle")
CHUNKS = 64
CREATED = 1_796_000_000
COMPLETION_ID = "chatcmpl-bench0000000000000000000000000000"


def _response(status: bytes, ctype: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype
    return head + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _json(obj: object) -> bytes:
    return _response(b"200 OK", b"application/json", orjson.dumps(obj))


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk (vLLM answers streams with chunked transfer encoding)."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


STAMP = b"@0000000000.000000"  # paced chunks carry their send time (CLOCK_MONOTONIC) here


def _event(model: str, i: int) -> bytes:
    stamp = STAMP.decode() if model != "fast" else ""
    delta: dict[str, str] = {"content": f" tok{i}{stamp}"}
    if i == 0:
        delta = {"role": "assistant", "content": stamp}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    if i == CHUNKS - 1:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    obj = {
        "id": COMPLETION_ID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": model,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _completion(model: str) -> bytes:
    text = "".join(f" tok{i}" for i in range(1, CHUNKS - 1))
    return _json(
        {
            "id": COMPLETION_ID,
            "object": "chat.completion",
            "created": CREATED,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": {
                "prompt_tokens": 12,
                "total_tokens": 12 + CHUNKS,
                "completion_tokens": CHUNKS,
            },
        }
    )


def _stamped(event: bytes) -> bytes:
    """The event with the moment it leaves (fixed width, so the chunk length is unchanged)."""
    return event.replace(STAMP, b"@%017.6f" % time.perf_counter(), 1)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Canned:
    """Every byte this server will ever send, built once."""

    def __init__(self) -> None:
        self.completion = {m: _completion(m) for m in MODELS}
        self.events = {m: [_chunk(_event(m, i)) for i in range(CHUNKS)] for m in MODELS}
        self.stream = {m: SSE_HEAD + b"".join(self.events[m]) + DONE for m in MODELS}
        cards = [
            {
                "id": m,
                "object": "model",
                "created": CREATED,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": 32768,
            }
            for m in MODELS
        ]
        metrics = "".join(
            f'vllm:{g}{{model_name="{m}"}} 0.0\n'
            for m in MODELS
            for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        )
        # what precise prefix routing reads (gpupool-precise): vLLM's defaults, a GPU's blocks
        metrics += (
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
            'num_gpu_blocks="100000",prefix_caching_hash_algo="sha256"} 1.0\n'
        )
        metrics_bytes = metrics.encode()
        self.get = {
            b"/health": b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"/v1/models": _json({"object": "list", "data": cards}),
            b"/metrics": _response(b"200 OK", b"text/plain; version=0.0.4", metrics_bytes),
            b"/version": _json({"version": "0.32.0"}),
            b"/get_server_info": _json({"model_path": "fast", "max_total_num_tokens": 32768}),
            b"/get_model_info": _json({"model_path": "fast", "is_generation": True}),
        }
        self.not_found = _response(b"404 Not Found", b"application/json", b'{"detail":"no"}')


class Upstream(asyncio.Protocol):
    def __init__(self, canned: Canned, pace_s: float, idle_s: float) -> None:
        self.canned, self.pace_s, self.idle_s = canned, pace_s, idle_s
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        if transport is None:
            return
        path = self.url.split(b"?", 1)[0]
        if self.parser.get_method() == b"GET":
            transport.write(self.canned.get.get(path, self.canned.not_found))
            return
        try:
            req = orjson.loads(b"".join(self.body))
        except orjson.JSONDecodeError:
            req = {}
        model = req.get("model") if isinstance(req, dict) else None
        model = model if model in MODELS else "fast"
        if not req.get("stream"):
            transport.write(self.canned.completion[model])
        elif model == "fast":
            transport.write(self.canned.stream[model])
        else:
            transport.write(SSE_HEAD + _stamped(self.canned.events[model][0]))
            gap = self.pace_s if model == "paced" else self.idle_s
            self._next(model, 1, gap)

    def _next(self, model: str, i: int, gap: float) -> None:
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(gap, self._emit, model, i, gap)

    def _emit(self, model: str, i: int, gap: float) -> None:
        self.timer = None
        if self.transport is None:
            return
        self.transport.write(_stamped(self.canned.events[model][i]))
        if i + 1 < CHUNKS:
            self._next(model, i + 1, gap)
        else:
            self.transport.write(DONE)


async def serve(port: int, pace_s: float, idle_s: float) -> None:
    canned = Canned()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Upstream(canned, pace_s, idle_s),
        "127.0.0.1",
        port,
        backlog=8192,
        reuse_address=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pace-ms", type=float, default=20.0, help="Gap between `paced` chunks.")
    parser.add_argument("--idle-s", type=float, default=20.0, help="Gap between `idle` chunks.")
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.pace_ms / 1000, args.idle_s))


if __name__ == "__main__":
    main()
