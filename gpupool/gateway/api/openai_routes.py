"""OpenAI-compatible routes: parse, call the proxy, return. Nothing else lives here."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from gpupool.gateway.api.endpoint import Endpoint, body, request_id, services
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.errors import Forbidden, InvalidBody
from gpupool.gateway.parse import Generate, parse_generate, parse_model_only
from gpupool.gateway.proxy import Context
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits import close_after
from gpupool.gateway.upstream.client import forward_headers

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

Call = Callable[[], Awaitable[Reply]]
log = logging.getLogger("gpupool.requests")


def _header_number(request: Request, name: str) -> float | None:
    value = request.headers.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidBody(f"Header `{name}` must be a number.") from None


def _tenant(request: Request) -> str:
    state = request.scope.get("state", {})
    if "tenant" in state:
        return str(state["tenant"])
    key = request.headers.get("authorization") or request.headers.get("x-api-key")
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else "anonymous"


def context(request: Request, req: Generate | None = None) -> Context:
    rid = request_id(request)
    prio = _header_number(request, "x-gpupool-priority")
    priority = int(prio) if prio is not None else (req.priority if req and req.priority else 0)
    state = request.scope.get("state", {})
    lo, hi = state.get("priority_range", (None, None))
    if lo is not None:
        priority = min(max(priority, lo), hi)
    headers = forward_headers(request.headers)
    headers["content-type"] = "application/json"
    headers["x-request-id"] = rid
    return Context(rid, _tenant(request), priority, _header_number(request, "x-gpupool-max-wait"),
                   headers)  # fmt: skip


def _principal(request: Request) -> Principal | None:
    p = request.scope.get("state", {}).get("principal")
    return p if isinstance(p, Principal) else None


def _check_model_allowed(principal: Principal | None, svc: Services, name: str | None) -> None:
    if principal is None or principal.key is None or principal.key.models is None:
        return
    model = svc.catalog.resolve(name)
    if not {model.name, *model.aliases} & set(principal.key.models):
        raise Forbidden(f"This key may not use model `{name or model.name}`.", param="model")


async def _limited(svc: Services, request: Request, ctx: Context, call: Call) -> Reply:
    """Run ``call`` under the caller's per-key limits (released when the reply ends)."""
    hold = await svc.key_limits.admit(_principal(request))
    try:
        reply = await call()
    except BaseException:
        await hold.close(0)
        raise
    if hold.limits is None:
        return reply  # no per-key limits: nothing to release, no extra layer on the stream
    if reply.stream is not None:
        reply.stream = close_after(reply.stream, hold, ctx.tokens)
    else:
        await hold.close(sum(ctx.tokens))
    return reply


def _generate(path: str, chat: bool) -> Endpoint:
    async def handler(request: Request) -> ASGIApp:
        svc = services(request)
        raw = await body(request)
        if svc.cfg.server.log_prompts:
            log.info("%s body: %s", path, raw[:8192].decode("utf-8", "replace"))
        server = svc.cfg.server
        req = parse_generate(raw, chat=chat, max_depth=server.max_json_depth, max_n=server.max_n)
        _check_model_allowed(_principal(request), svc, req.model)
        ctx = context(request, req)
        reply = await _limited(svc, request, ctx, lambda: svc.proxy.generate(path, req, ctx))
        return ReplyResponse(reply)

    return Endpoint(handler)


def _passthrough(path: str) -> Endpoint:
    async def handler(request: Request) -> ASGIApp:
        svc = services(request)
        raw = await body(request)
        _, model = parse_model_only(raw, svc.cfg.server.max_json_depth)
        _check_model_allowed(_principal(request), svc, model)
        ctx = context(request)
        reply = await _limited(
            svc, request, ctx, lambda: svc.proxy.passthrough("POST", path, raw, model, ctx)
        )
        return ReplyResponse(reply)

    return Endpoint(handler)


async def list_models(request: Request) -> ASGIApp:
    svc = services(request)
    cards = svc.catalog.cards(svc.registry)
    return ReplyResponse(Reply.json(200, {"object": "list", "data": cards}))


async def get_model(request: Request) -> ASGIApp:
    svc = services(request)
    card = svc.catalog.card(request.path_params["model_id"], svc.registry)
    return ReplyResponse(Reply.json(200, card))


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", _generate("/v1/chat/completions", True), methods=["POST"]),
        Route("/v1/completions", _generate("/v1/completions", False), methods=["POST"]),
        Route("/v1/models", Endpoint(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", Endpoint(get_model), methods=["GET"]),
        *(
            Route(p, _passthrough(p), methods=["POST"])
            for p in ("/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize")
        ),
    ]
