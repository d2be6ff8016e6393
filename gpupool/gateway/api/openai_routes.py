"""OpenAI-compatible routes: parse, call the proxy, return. Nothing else lives here.

The POST routes are plain ``handler(services, incoming, body) -> Reply`` functions, served by
the front door without Starlette; only the model list goes through Starlette's router.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from gpupool.gateway.api.endpoint import Endpoint, services
from gpupool.gateway.api.incoming import Incoming
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.errors import Forbidden
from gpupool.gateway.parse import Generate, parse_generate, parse_model_only
from gpupool.gateway.proxy import Context
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits import close_after

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

Call = Callable[[], Awaitable[Reply]]
BodyHandler = Callable[["Services", Incoming, bytes], Awaitable[Reply]]
log = logging.getLogger("gpupool.requests")


def context(incoming: Incoming, req: Generate | None = None) -> Context:
    prio = incoming.number(b"x-gpupool-priority")
    priority = int(prio) if prio is not None else (req.priority if req and req.priority else 0)
    allowed = incoming.priority_range()
    if allowed is not None:
        priority = min(max(priority, allowed[0]), allowed[1])
    headers = incoming.forward_headers()
    headers["content-type"] = "application/json"
    headers["x-request-id"] = incoming.request_id
    max_wait = incoming.number(b"x-gpupool-max-wait")
    return Context(incoming.request_id, incoming.tenant(), priority, max_wait, headers)


def _check_model_allowed(principal: Principal | None, svc: Services, name: str | None) -> None:
    if principal is None or principal.key is None or principal.key.models is None:
        return
    model = svc.catalog.resolve(name)
    if not {model.name, *model.aliases} & set(principal.key.models):
        raise Forbidden(f"This key may not use model `{name or model.name}`.", param="model")


async def _limited(svc: Services, incoming: Incoming, ctx: Context, call: Call) -> Reply:
    """Run ``call`` under the caller's per-key limits (released when the reply ends)."""
    hold = await svc.key_limits.admit(incoming.principal)
    try:
        reply = await call()
    except BaseException:
        await hold.close(0)
        raise
    if hold.limits is None:
        return reply  # no per-key limits: nothing to release, no extra layer on the stream
    if reply.stream is not None:
        reply.stream = close_after(reply.stream, hold, ctx.tokens)
        return reply
    before = reply.after

    async def after() -> None:
        try:
            if before is not None:
                await before()  # reads the usage that counts against the key
        finally:
            await hold.close(sum(ctx.tokens))

    reply.after = after
    return reply


def generate(path: str, chat: bool) -> BodyHandler:
    """The handler of /v1/chat/completions (``chat``) or /v1/completions."""

    async def handler(svc: Services, incoming: Incoming, raw: bytes) -> Reply:
        server = svc.cfg.server
        if server.log_prompts:
            log.info("%s body: %s", path, raw[:8192].decode("utf-8", "replace"))
        req = parse_generate(raw, chat=chat, max_depth=server.max_json_depth, max_n=server.max_n)
        _check_model_allowed(incoming.principal, svc, req.model)
        ctx = context(incoming, req)
        return await _limited(svc, incoming, ctx, lambda: svc.proxy.generate(path, req, ctx))

    return handler


def passthrough(path: str) -> BodyHandler:
    """A vLLM route gpupool forwards as is, to the least loaded ready worker of the model."""

    async def handler(svc: Services, incoming: Incoming, raw: bytes) -> Reply:
        _, model = parse_model_only(raw, svc.cfg.server.max_json_depth)
        _check_model_allowed(incoming.principal, svc, model)
        ctx = context(incoming)
        call = lambda: svc.proxy.passthrough("POST", path, raw, model, ctx)  # noqa: E731
        return await _limited(svc, incoming, ctx, call)

    return handler


BODY_ROUTES: dict[str, BodyHandler] = {
    "/v1/chat/completions": generate("/v1/chat/completions", True),
    "/v1/completions": generate("/v1/completions", False),
    **{p: passthrough(p) for p in ("/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize")},
}
"""POST routes whose body goes to a worker; served by the front door (``front.py``)."""


async def list_models(request: Request) -> ASGIApp:
    svc = services(request)
    cards = svc.catalog.cards(svc.registry)
    return ReplyResponse(Reply.json(200, {"object": "list", "data": cards}))


async def get_model(request: Request) -> ASGIApp:
    svc = services(request)
    card = svc.catalog.card(request.path_params["model_id"], svc.registry)
    return ReplyResponse(Reply.json(200, card))


def routes() -> list[Route]:
    """The routes left to Starlette: the model list (the POST routes are in BODY_ROUTES)."""
    return [
        Route("/v1/models", Endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", Endpoint(get_model), methods=["GET"]),
    ]
