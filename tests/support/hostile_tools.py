"""What the hostile-client and fault suites check after every case, and a recording upstream.

:func:`assert_nothing_held` reads ``GET /admin/held``: in-flight per worker, admission's slots
(memory or Redis), queued requests and per-key concurrency slots must all be back to zero
within a second of the last client leaving. :class:`Recorder` is a worker stand-in that keeps
every body it receives, so a test can see exactly what gpupool forwarded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from tests.support.procs import free_port


def held(gw: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = httpx.get(gw + "/admin/held", headers=headers or {}, timeout=10)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def _total(snapshot: dict[str, Any]) -> int:
    return sum(sum(int(v) for v in part.values()) for part in snapshot.values())


def assert_nothing_held(
    gw: str, headers: dict[str, str] | None = None, within_s: float = 1.0
) -> dict[str, Any]:
    """Everything back to zero within ``within_s`` (after the last client left)."""
    deadline = time.monotonic() + within_s
    snapshot = held(gw, headers)
    while _total(snapshot) and time.monotonic() < deadline:
        time.sleep(0.05)
        snapshot = held(gw, headers)
    assert _total(snapshot) == 0, f"still held a second after the last client left: {snapshot}"
    return snapshot


class Recorder:
    """A worker stand-in (pure ASGI under uvicorn, in a thread) that records request bodies."""

    def __init__(self, model: str = "m", window: int = 4096) -> None:
        self.model = model
        self.window = window
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        more = True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        body = json.loads(raw or b"{}") if scope["method"] == "POST" else {}
        if scope["method"] == "POST":
            self.bodies.append((path, body))
        if body.get("stream"):
            await self._stream(send)
            return
        out = self._answer(path)
        if body.get("prompt") == "big":  # a large reply, at once
            out["choices"][0]["text"] = "x" * (16 << 20)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": json.dumps(out).encode()})

    async def _stream(self, send: Any) -> None:
        """Ten chunks a tenth of a second apart, then [DONE]."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for i in range(10):
            chunk = {"id": "s", "object": "text_completion", "model": self.model,
                     "choices": [{"index": 0, "text": str(i), "finish_reason": None}]}  # fmt: skip
            event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _answer(self, path: str) -> dict[str, Any]:
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.window}
            return {"object": "list", "data": [card]}
        if path == "/tokenize":
            return {"count": 3, "max_model_len": self.window, "tokens": [1, 2, 3]}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        choice = {"index": 0, "text": "ok", "finish_reason": "stop"}
        return {"id": "x", "object": "text_completion", "model": self.model,
                "choices": [choice], "usage": usage}  # fmt: skip

    @contextmanager
    def running(self) -> Iterator[Recorder]:
        with serve_in_thread(self, self.port):
            yield self


@contextmanager
def serve_in_thread(app: Any, port: int) -> Iterator[None]:
    """A uvicorn server for ``app`` on loopback ``port`` in a thread, stopped on exit."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(5)
