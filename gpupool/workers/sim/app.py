"""The simulator's HTTP side: a raw ASGI app (cheaper per request than a framework) and its
uvicorn runner.

Routing is a dict lookup; unknown paths get Starlette's ``{"detail": "Not Found"}`` (what vLLM
answers for routes it did not register, such as ``/v1/embeddings`` on a generate model).
Requests that may wait (a busy engine, latency, holds, a hang) run in a task raced against the
client's disconnect, which cancels the work and frees the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.errors import SimError
from gpupool.workers.sim.jobs import Meta
from gpupool.workers.sim.service import JsonReply, Reply, SimService, StreamReply

Handler = Callable[[bytes, Meta], Awaitable[Reply]]
MayBlock = Callable[[Meta], bool]
_NOT_FOUND = b'{"detail":"Not Found"}'
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
log = logging.getLogger("gpupool.sim")


class SimApp:
    """ASGI application; ``service`` is exposed for in-process tests."""

    def __init__(self, config: SimConfig) -> None:
        self.service = s = SimService(config)
        hung: MayBlock = lambda _meta: s.knobs.hang  # noqa: E731
        self._routes: dict[str, dict[str, tuple[Handler, MayBlock | None]]] = {
            "/v1/chat/completions": {"POST": (s.chat, s.blocking)},
            "/v1/completions": {"POST": (s.completions, s.blocking)},
            "/v1/responses": {"POST": (s.responses, s.blocking)},
            "/health": {"GET": (s.health, hung)},
            "/ping": {"GET": (s.health, hung), "POST": (s.health, hung)},
            "/version": {"GET": (s.version, None)},
            "/load": {"GET": (s.load, None)},
            "/v1/models": {"GET": (s.models, None)},
            "/metrics": {"GET": (s.metrics, None)},
            "/tokenize": {"POST": (s.tokenize, None)},
            "/detokenize": {"POST": (s.detokenize, None)},
            "/sim/stats": {"GET": (s.sim_stats, None)},
            "/sim/control": {"POST": (s.sim_control, None)},
            "/sim/reset": {"POST": (s.sim_reset, None)},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        methods = self._routes.get(scope["path"])
        if methods is None:
            await _send_json(send, JsonReply(404, _NOT_FOUND))
            return
        entry = methods.get(scope["method"])
        if entry is None:
            allow = ", ".join(sorted(methods)).encode()
            await _send_json(send, JsonReply(405, _NOT_ALLOWED), [(b"allow", allow)])
            return
        handler, may_block = entry
        body = await _read_body(receive)
        meta = _meta(scope)
        work = _serve(handler, body, meta, send)
        if may_block is not None and may_block(meta):
            await _race_disconnect(work, receive)
        else:
            await work


def create_sim_app(config: SimConfig) -> SimApp:
    return SimApp(config)


def run_sim(config: SimConfig) -> None:
    """Serve until SIGINT/SIGTERM. Like vLLM, nothing listens during ``startup_delay_s``."""
    app = create_sim_app(config)
    if config.startup_delay_s > 0:
        time.sleep(config.startup_delay_s)
    print(
        f"INFO: Starting vLLM server on http://{config.host}:{config.port}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=5,  # hung requests must not keep SIGTERM waiting
    )


async def _serve(handler: Handler, body: bytes, meta: Meta, send: Send) -> None:
    try:
        reply = await handler(body, meta)
    except SimError as exc:
        reply = JsonReply(exc.status, exc.to_json())
    if isinstance(reply, StreamReply):
        await _send_stream(send, reply)
    else:
        await _send_json(send, reply)


async def _send_json(
    send: Send, reply: JsonReply, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-length", str(len(reply.body)).encode())]
    if reply.content_type is not None:
        headers.append((b"content-type", reply.content_type))
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


async def _send_stream(send: Send, reply: StreamReply) -> None:
    chunks = reply.chunks
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except SimError as exc:  # pragma: no cover - streams report their own errors
        log.warning("stream failed: %s", exc.message)
    finally:
        await chunks.aclose()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _race_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run ``work``; cancel it if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(receive: Receive) -> bytes:
    message: Message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        parts.append(message.get("body", b""))
    return b"".join(parts)


def _meta(scope: Scope) -> Meta:
    meta = Meta(arrival=time.monotonic())
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            meta.request_id = value.decode("latin-1")
        elif name == b"x-sim-hold-ms":
            with contextlib.suppress(ValueError):
                meta.hold_s = max(0.0, float(value) / 1000.0)
    return meta


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
