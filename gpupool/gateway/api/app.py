"""``create_app(config)``: the only place the HTTP application is assembled."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.api import admin_routes, openai_routes, ui_routes
from gpupool.gateway.api.endpoint import Endpoint, services
from gpupool.gateway.api.errors import gateway_error, http_error, unexpected_error
from gpupool.gateway.api.front import Front
from gpupool.gateway.api.middleware import RequestIdMiddleware
from gpupool.gateway.api.openapi import openapi_schema
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.errors import GatewayError
from gpupool.gateway.reload import reload_on_sighup
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.middleware import AuthMiddleware
from gpupool.gateway.services import Services, build_services


async def health(request: Request) -> ASGIApp:
    """Process alive: 200 while the gateway runs (always open, no key)."""
    return ReplyResponse(Reply(200, [("content-type", "application/json")], b""))


async def ready(request: Request) -> ASGIApp:
    """200 once every model has a ready worker (or an asleep one woken on demand); else 503 and
    the missing models."""
    svc = services(request)
    missing = [m.name for m in svc.cfg.models if not svc.registry.serving_of_model(m.name)]
    status = 503 if missing else 200
    return ReplyResponse(Reply.json(status, {"ready": not missing, "missing_models": missing}))


async def metrics(request: Request) -> ASGIApp:
    """The gateway's Prometheus metrics (docs: Reference, Metrics)."""
    svc = services(request)
    await svc.refresh_gauges()
    body = svc.metrics.exposition()
    ctype = "text/plain; version=0.0.4; charset=utf-8"
    return ReplyResponse(Reply(200, [("content-type", ctype)], body))


async def openapi(request: Request) -> ASGIApp:
    """The gateway's OpenAPI document (the client routes)."""
    return ReplyResponse(Reply.json(200, openapi_schema()))


def create_app(
    cfg: GpupoolConfig,
    *,
    config_path: str | Path | None = None,
    svc: Services | None = None,
    on_services: Callable[[Services], None] | None = None,
) -> Front:
    """Build the gateway: the front door (``front.py``) in front of a Starlette app.

    ``svc`` lets tests pass services built with fakes. Services are built inside the lifespan,
    on the server's event loop.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        built = svc or build_services(cfg, config_path=config_path)
        if on_services is not None:
            on_services(built)
        app.state.services = front.services = built
        front.auth = built.auth  # the one a reload swaps (the middleware finds it on the state)
        built.reload_hooks.append(front.configure)
        await built.start()
        stop_hup = reload_on_sighup(built)  # `kill -HUP` reloads the config, as the admin route
        feed = ui_routes.start_feed(app, built)  # the pool page's live feed (GET /ui)
        # Everything built so far lives as long as the server: move it out of the cyclic
        # collector's sight, so a full collection under load walks only per-request garbage
        # (measured here: ~30 ms for the ~75k start-up objects, against well under 0.1 ms).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            stop_hup()
            await feed.close()
            await built.close()

    app = Starlette(
        routes=[
            Route("/health", Endpoint(health), methods=["GET"]),
            Route("/ready", Endpoint(ready), methods=["GET"]),
            Route("/metrics", Endpoint(metrics), methods=["GET"]),
            Route("/openapi.json", Endpoint(openapi), methods=["GET"]),
            *openai_routes.routes(),
            *admin_routes.routes(),
            *ui_routes.routes(),
        ],
        middleware=[Middleware(RequestIdMiddleware), Middleware(AuthMiddleware, cfg=cfg.auth)],
        exception_handlers={
            GatewayError: gateway_error,
            HTTPException: http_error,
            Exception: unexpected_error,
        },
        lifespan=lifespan,
    )
    # No redirect from `/path/` to `/path`: Starlette builds its target from the client's
    # `Host`, which a client (or a DNS-rebinding page) chooses; `/ui/` has its own route.
    app.router.redirect_slashes = False
    front = Front(app, cfg)
    return front
