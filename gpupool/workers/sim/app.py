"""The simulator's HTTP side: a raw ASGI app (cheaper per request than a framework) and its
uvicorn runner.

Routing is a dict lookup; unknown paths get Starlette's ``{"detail": "Not Found"}`` (what vLLM
answers for routes it did not register, such as ``/v1/embeddings`` on a generate model).
Every response carries ``vary: Origin``, as vLLM's CORS middleware adds it.
Requests that may wait (a busy engine, latency, holds, a hang) run in a task raced against the
client's disconnect, which cancels the work and frees the slot.

SIGTERM or SIGINT does what vLLM's default (``--shutdown-timeout 0``) does: the engine dies at
once, so generations in flight end with vLLM's engine-dead error (a 500, or inside a started
stream an error event and ``[DONE]``), the server stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from gpupool.workers.sim import render
from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.errors import SimError
from gpupool.workers.sim.jobs import Meta
from gpupool.workers.sim.service import JsonReply, Reply, SimService, StreamReply
from gpupool.workers.sim.sleep import SleepMode, SleepSettings, settings_from_context
from gpupool.workers.sim.stored import PREFIX as STORED

Handler = Callable[[bytes, Meta], Awaitable[Reply]]
MayBlock = Callable[[Meta], bool]
_NOT_FOUND = b'{"detail":"Not Found"}'
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_VARY = (b"vary", b"Origin")
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), _VARY]
_GENERATION = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
)
_ENGINE_DEAD = JsonReply(500, SimError().to_json())
_ENGINE_DEAD_EVENT = render.error_event(SimError()) + render.DONE
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
log = logging.getLogger("gpupool.sim")


class SimApp:
    """ASGI application; ``service`` is exposed for in-process tests."""

    def __init__(self, config: SimConfig, sleep: SleepSettings | None = None) -> None:
        self.sleep = SleepMode(sleep) if sleep is not None else None  # sleep.py
        self.service = s = SimService(config)
        self.engine_dead = False
        self._generating: set[asyncio.Task[Any]] = set()
        self._killed: set[asyncio.Task[Any]] = set()
        hung: MayBlock = lambda _meta: s.knobs.hang  # noqa: E731
        self._routes: dict[str, dict[str, tuple[Handler, MayBlock | None]]] = {
            "/v1/chat/completions": {"POST": (s.chat, s.blocking)},
            "/v1/completions": {"POST": (s.completions, s.blocking)},
            "/v1/responses": {"POST": (s.responses, s.blocking)},
            "/v1/messages": {"POST": (s.messages, s.blocking)},  # vLLM's Anthropic adapter
            "/v1/messages/count_tokens": {"POST": (s.count_tokens, None)},
            "/health": {"GET": (s.health, hung)},
            "/ping": {"GET": (s.health, hung), "POST": (s.health, hung)},
            "/version": {"GET": (s.version, None)},
            "/load": {"GET": (s.load, None)},
            "/v1/models": {"GET": (s.models, None)},
            "/metrics": {"GET": (s.metrics, None)},
            "/metrics/": {"GET": (s.metrics, None)},  # vLLM's mount path (probe.FILTERED_METRICS)
            "/tokenize": {"POST": (s.tokenize, None)},
            "/detokenize": {"POST": (s.detokenize, None)},
            "/sim/stats": {"GET": (s.sim_stats, None)},
            "/sim/control": {"POST": (s.sim_control, None)},
            "/sim/reset": {"POST": (s.sim_reset, None)},
            "/reset_prefix_cache": {"POST": (s.reset_prefix_cache, None)},  # vLLM's dev route
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.sleep is not None and await self.sleep.handle(scope, receive, send):
            return
        if scope["path"].startswith(STORED):  # GET /v1/responses/{id}, POST …/cancel
            await self._stored(scope, receive, send)
            return
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
        if scope["path"] in _GENERATION:
            work = self._generate(handler, body, meta, send)
        else:
            work = _serve(handler, body, meta, send)
        if may_block is not None and may_block(meta):
            await _race_disconnect(work, receive)
        else:
            await work

    async def _stored(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _read_body(receive)
        query: bytes = scope.get("query_string", b"")
        status, body, allow = self.service.stored.answer(scope["method"], scope["path"], query)
        extra = [(b"allow", allow.encode())] if allow else None
        await _send_json(send, JsonReply(status, body), extra)

    def kill_engine(self) -> None:
        """The engine dies: generations in flight end with vLLM's engine-dead error, new ones
        get it at once."""
        self.engine_dead = True
        self._killed.update(self._generating)
        for task in self._killed:
            task.cancel()

    async def _generate(self, handler: Handler, body: bytes, meta: Meta, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._generating.add(task)
        try:
            try:
                reply = _ENGINE_DEAD if self.engine_dead else await handler(body, meta)
            except SimError as exc:
                reply = JsonReply(exc.status, exc.to_json())
            except asyncio.CancelledError:
                if not self._engine_killed(task):
                    raise
                reply = _ENGINE_DEAD
            if isinstance(reply, StreamReply):
                await self._send_stream(send, reply, task)
            else:
                await _send_json(send, reply)
        finally:
            self._generating.discard(task)
            if self.sleep is not None:
                self.sleep.generation_ended()

    async def _send_stream(self, send: Send, reply: StreamReply, task: asyncio.Task[Any]) -> None:
        chunks = reply.chunks
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            if not self._engine_killed(task):
                raise
            await send(
                {"type": "http.response.body", "body": _ENGINE_DEAD_EVENT, "more_body": True}
            )
        finally:
            await chunks.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _engine_killed(self, task: asyncio.Task[Any]) -> bool:
        """Whether the engine's death cancelled ``task``; if so, the task carries on (to report
        it) and is no longer counted as cancelled."""
        if task not in self._killed:
            return False
        self._killed.discard(task)
        task.uncancel()
        return True


class _Server(uvicorn.Server):
    """uvicorn with vLLM's signal handling: kill the engine, stop serving, exit 0."""

    def __init__(self, config: uvicorn.Config, app: SimApp) -> None:
        super().__init__(config)
        self._app = app

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        self.force_exit = self.should_exit  # a second signal stops waiting for hung requests
        self.should_exit = True
        self._app.kill_engine()


def create_sim_app(config: SimConfig, sleep: SleepSettings | None = None) -> SimApp:
    app = SimApp(config, sleep)
    if app.sleep is not None:
        app.sleep.running = lambda: len(app._generating)
        app.sleep.abort = app.service.engine.abort_all
        app.sleep.freeze = app.service.engine.freeze
        app.sleep.thaw = app.service.engine.thaw
        app.sleep.clear_cache = app.service.engine.cache.clear
        mode = app.sleep
        app.service.jobs.text.garbled = lambda: mode.garbled
    return app


def run_sim(config: SimConfig) -> None:
    """Serve until SIGINT/SIGTERM. Like vLLM, nothing listens during ``startup_delay_s``."""
    app = create_sim_app(config, settings_from_context())
    if config.startup_delay_s > 0:
        time.sleep(config.startup_delay_s)
    print(
        f"INFO: Starting vLLM server on http://{config.host}:{config.port}",
        file=sys.stderr,
        flush=True,
    )
    uv_config = uvicorn.Config(
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
    _Server(uv_config, app).run()


async def _serve(handler: Handler, body: bytes, meta: Meta, send: Send) -> None:
    try:
        reply = await handler(body, meta)
    except SimError as exc:
        reply = JsonReply(exc.status, exc.to_json())
    assert isinstance(reply, JsonReply), "only generation routes stream"
    await _send_json(send, reply)


async def _send_json(
    send: Send, reply: JsonReply, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-length", str(len(reply.body)).encode())]
    if reply.content_type is not None:
        headers.append((b"content-type", reply.content_type))
    if extra:
        headers.extend(extra)
    headers.append(_VARY)
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


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
    meta = Meta(arrival=time.monotonic(), media_ok=False)
    for name, value in scope["headers"]:
        if name == b"content-type":
            meta.media_ok = value.lower().split(b";", 1)[0] == b"application/json"
        elif name == b"x-request-id":
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
