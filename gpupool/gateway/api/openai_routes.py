"""OpenAI-compatible routes: parse, call the pipeline, return. Nothing else lives here.

Every token-bearing POST route (``pipeline/kinds.py``) is served by the front door without
Starlette, through one handler: the pipeline. Only the model list goes through Starlette's
router; it shows a key only the models it may use.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from gpupool.gateway.api.endpoint import Endpoint, services
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.pipeline.kinds import KINDS, Kind
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.keys import Principal

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

BodyHandler = Callable[["Services", Incoming, bytes], Awaitable[Reply]]
log = logging.getLogger("gpupool.requests")


def handler_of(kind: Kind) -> BodyHandler:
    async def handler(svc: Services, incoming: Incoming, raw: bytes) -> Reply:
        if svc.cfg.server.log_prompts:
            log.info("%s body: %s", kind.path, raw[:8192].decode("utf-8", "replace"))
        return await svc.pipeline.handle(kind, incoming, raw)

    return handler


BODY_ROUTES: dict[str, BodyHandler] = {path: handler_of(kind) for path, kind in KINDS.items()}
"""POST routes whose body goes to a worker; served by the front door (``front.py``)."""


def _allowed(request: Request) -> frozenset[str] | None:
    principal = request.scope.get("state", {}).get("principal")
    if not isinstance(principal, Principal) or principal.key is None:
        return None
    models = principal.key.models
    return frozenset(models) if models is not None else None


async def list_models(request: Request) -> ASGIApp:
    svc = services(request)
    cards = svc.catalog.cards(svc.registry, _allowed(request))
    return ReplyResponse(Reply.json(200, {"object": "list", "data": cards}))


async def get_model(request: Request) -> ASGIApp:
    svc = services(request)
    card = svc.catalog.card(request.path_params["model_id"], svc.registry, _allowed(request))
    return ReplyResponse(Reply.json(200, card))


def routes() -> list[Route]:
    """The routes left to Starlette: the model list (the POST routes are in BODY_ROUTES)."""
    return [
        Route("/v1/models", Endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", Endpoint(get_model), methods=["GET"]),
    ]
