"""The pool page: ``GET /ui`` (static files from ``gpupool/gateway/ui``) and its one live feed,
``GET /admin/events`` (server-sent events, admin key in a header like every admin route).

The page itself holds no data, so its three files are served without a key (the auth
middleware's open paths): the page asks for the admin key, keeps it in the tab's session
storage and sends it in a header, with ``fetch()``, on the event stream and on every action
(the existing ``/admin`` routes). A cookie never carries it, so no other site can make the
browser act with it (CSRF), and every reply here forbids framing (clickjacking), inline
scripts and other origins (CSP), and content sniffing.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, cast

import orjson
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpupool.gateway.api.endpoint import Endpoint, services
from gpupool.gateway.api.middleware import current_request_id
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.errors import InvalidBody, RateLimited
from gpupool.gateway.reply import SSE, Reply
from gpupool.gateway.ui.feed import PoolFeed

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from gpupool.gateway.services import Services

# served without a key (security/middleware.py opens them); /ui/ is redirected to /ui
PAGE_PATHS = frozenset({"/ui", "/ui/", "/ui/app.js", "/ui/app.css"})
EVERY_S = 2.0  # a snapshot at least this often (and at once when a worker changes state)
MAX_STREAMS = 16  # open pool pages per gateway; more get 429
# A stream ends after this long and the page opens the next at once: uvicorn's graceful
# shutdown waits for open responses, and nothing tells a response that the server is stopping,
# so a gateway stopping with a page open waits at most this long for it (less than the
# default `server.shutdown_grace_s`).
STREAM_S = 15.0

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = [
    ("content-security-policy", CSP),
    ("x-frame-options", "DENY"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-store"),
]
_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}


def _files() -> dict[str, bytes]:
    """The page's files, read once when the routes are built."""
    folder = resources.files("gpupool.gateway.ui")
    return {name: folder.joinpath(name).read_bytes() for name in _TYPES}


@dataclass(slots=True)
class UiState:
    """What the page's routes share: the feed (set by the lifespan) and the open streams."""

    feed: PoolFeed | None = None
    streams: int = 0


def start_feed(app: Starlette, svc: Services) -> PoolFeed:
    """Attach the page's feed to ``svc`` (the app's lifespan; :meth:`PoolFeed.close` after)."""
    feed = PoolFeed.attach(svc, current_request_id.get)
    _ui(app).feed = feed
    return feed


def _ui(app: Starlette) -> UiState:
    state = getattr(app.state, "ui", None)
    if state is None:
        state = app.state.ui = UiState()
    return cast("UiState", state)


def static(name: str, body: bytes) -> Endpoint:
    async def serve(request: Request) -> ASGIApp:
        if request.query_params:
            raise InvalidBody("The pool page takes no query parameters.")
        page = body
        if name == "index.html":  # whether to ask for the key first (auth follows a reload)
            page = body.replace(b"__ADMIN__", b"key" if _needs_key(request) else b"open")
        return ReplyResponse(Reply(200, [("content-type", _TYPES[name]), *HEADERS], page))

    return Endpoint(serve)


def _needs_key(request: Request) -> bool:
    return services(request).auth.cfg.enabled


async def events(request: Request) -> ASGIApp:
    """The pool page's feed: an ``event: pool`` with the whole snapshot (``feed.py``) at once,
    on every worker state change and at least every ``EVERY_S``, until the client leaves or
    ``STREAM_S`` has passed (the page then opens the next one)."""
    if request.query_params:
        raise InvalidBody("/admin/events takes no query parameters.")
    services(request)  # 500 before the stream starts, never in it, when the app has none
    ui = _ui(request.app)
    if ui.feed is None:
        raise RateLimited("The pool feed is starting; try again.", retry_after_s=1)
    if ui.streams >= MAX_STREAMS:
        raise RateLimited(
            f"Too many pool pages are open ({MAX_STREAMS}); close one.", retry_after_s=10
        )
    return EventStream(ui, ui.feed)


class EventStream:
    """One page's stream; the slot it counts is given back however it ends."""

    def __init__(self, ui: UiState, feed: PoolFeed) -> None:
        self.ui, self.feed = ui, feed
        ui.streams += 1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.Event()
        watch = asyncio.create_task(_until_disconnect(receive, gone))
        try:
            headers = [(b"content-type", SSE.encode()), (b"x-accel-buffering", b"no")]
            headers += [(k.encode(), v.encode()) for k, v in HEADERS]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._pump(send, gone)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away while we wrote
        finally:
            self.ui.streams -= 1
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    async def _pump(self, send: Send, gone: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + STREAM_S
        while not gone.is_set() and loop.time() < end:
            changed = self.feed.changed
            data = orjson.dumps(await self.feed.snapshot())
            await send({"type": "http.response.body", "body": b"event: pool\ndata: %b\n\n" % data,
                        "more_body": True})  # fmt: skip
            waits = [asyncio.ensure_future(e.wait()) for e in (changed, gone)]
            try:
                await asyncio.wait(waits, timeout=EVERY_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()


async def _until_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return


async def slash(request: Request) -> ASGIApp:
    """``/ui/`` → ``/ui``, by a relative ``Location`` (``../ui``): never a URL built from the
    client's ``Host`` (a forged one would be echoed into the redirect), and right behind a
    proxy that serves the gateway under a path prefix too."""
    if request.query_params:
        raise InvalidBody("The pool page takes no query parameters.")
    return ReplyResponse(Reply(307, [("location", "../ui"), *HEADERS], b""))


def routes() -> list[Route]:
    files = _files()
    return [
        Route("/ui", static("index.html", files["index.html"]), methods=["GET"]),
        Route("/ui/", Endpoint(slash), methods=["GET"]),
        Route("/ui/app.js", static("app.js", files["app.js"]), methods=["GET"]),
        Route("/ui/app.css", static("app.css", files["app.css"]), methods=["GET"]),
        Route("/admin/events", Endpoint(events), methods=["GET"]),
    ]
