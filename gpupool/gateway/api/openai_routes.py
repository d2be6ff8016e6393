"""OpenAI-compatible routes left to Starlette: the model list. Nothing else lives here.

Every token-bearing POST route (``pipeline/kinds.py``) is served by the front door
(``front.py``) without Starlette, straight into the pipeline. The model list goes through
Starlette's router; it shows a key only the models it may use.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from gpupool.gateway.api.endpoint import Endpoint, services
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.keys import Principal


def _allowed(request: Request) -> frozenset[str] | None:
    principal = request.scope.get("state", {}).get("principal")
    if not isinstance(principal, Principal) or principal.key is None:
        return None
    models = principal.key.models
    return frozenset(models) if models is not None else None


async def list_models(request: Request) -> ASGIApp:
    """The models ready workers serve (and asleep ones, woken on demand), with their aliases."""
    svc = services(request)
    cards = svc.catalog.cards(svc.registry, _allowed(request))
    return ReplyResponse(Reply.json(200, {"object": "list", "data": cards}))


async def get_model(request: Request) -> ASGIApp:
    """One model of the list, by name or alias; 404 in vLLM's shape when unknown."""
    svc = services(request)
    card = svc.catalog.card(request.path_params["model_id"], svc.registry, _allowed(request))
    return ReplyResponse(Reply.json(200, card))


def routes() -> list[Route]:
    """The routes left to Starlette: the model list (the POST routes are ``pipeline.KINDS``)."""
    return [
        Route("/v1/models", Endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", Endpoint(get_model), methods=["GET"]),
    ]
