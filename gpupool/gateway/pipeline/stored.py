"""Stored responses: made on one worker, used again only there, and only by their tenant.

vLLM keeps a stored ``/v1/responses`` response in the memory of the worker that made it, and
knows nothing of tenants. So the gateway:

* names every response itself (the body's ``request_id``, which vLLM makes the response's
  ``id``: ``resp_`` and the gateway's own request id, unique across tenants and replicas) and,
  once the worker accepts it, remembers ``id → (worker, tenant)`` (``tenancy/owners.py``),
  before any byte of the answer leaves;
* sends a request with ``previous_response_id`` to that worker only (no retry elsewhere:
  no other worker has it);
* serves ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N`` too), ``DELETE``,
  ``POST …/cancel`` and ``GET …/input_items`` on that worker, through the same guards as every
  route (key limits, a slot, the relay);
* waits for that worker while it sleeps (sleep mode, ``workers/swap``): a level 1 or 2 sleep
  keeps the process, so its stored responses are still there once it wakes. Admission grants
  slots only on ready workers, and the wait in the model's queue (``Slots.take``) is the
  demand that makes its swap group wake it, as for any request for a sleeping model; the
  queue's timeouts and limits apply;
* answers vLLM's own 404 (``Response with id '…' not found.``) to any other tenant and to an
  id it never made, so one tenant cannot even learn that another's id exists; and when the
  worker that made it is gone, the same 404 saying so;
* answers a 503 when the shared store of owners (Redis) cannot say (``tenancy/owners.py``):
  not a 404, since the response may well exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote

from gpupool.config.models import ModelConfig, ReasoningParser
from gpupool.gateway.admission.base import Ticket
from gpupool.gateway.admission.connection import StoreUnavailable
from gpupool.gateway.errors import (
    ClientGone,
    GatewayError,
    ModelNotFound,
    NotFound,
    ServiceUnavailable,
)
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.parse import Parsed
from gpupool.gateway.pipeline.context import build_context
from gpupool.gateway.pipeline.exchange import Exchange, Plan
from gpupool.gateway.pipeline.kinds import Kind, Shape, stored_target
from gpupool.gateway.reply import Reply
from gpupool.gateway.routing.policy import RouteRequest
from gpupool.gateway.security.limits import NO_HOLD
from gpupool.gateway.tenancy.owners import Owner, Owners
from gpupool.gateway.transform.chat import TransformOptions
from gpupool.workers.registry import SLEEP_STATES, WorkerState

if TYPE_CHECKING:
    from gpupool.gateway.pipeline.pipeline import Pipeline

# The states in which the worker's process (and so its stored responses) may still be there.
# Asleep, waking or falling asleep: kept by the process, served once it is ready again.
_HOLDS = frozenset({WorkerState.starting, WorkerState.warming, WorkerState.ready, *SLEEP_STATES})
_TRUE = frozenset({"1", "true", "yes", "on", "t", "y"})


class ResponseNotFound(NotFound):
    """vLLM's 404 for a response id it does not hold, in vLLM's words and shape."""

    type = "invalid_request_error"

    def __init__(self, response_id: str, why: str = "") -> None:
        super().__init__(f"Response with id '{response_id}' not found.{why}", param="response_id")


_GONE = " The worker that stored it is no longer serving, and stored responses live in its memory."


class OwnersUnavailable(ServiceUnavailable):
    """The store of who made each response could not be read (Redis down, hung or refusing)."""

    def __init__(self) -> None:
        super().__init__(
            "Stored responses cannot be looked up right now: the gateway's shared store is "
            "unavailable. Retry later."
        )


def response_id_for(request_id: str) -> str:
    """The id a response gets: vLLM's shape (``resp_`` and 32 hex digits), the gateway's id."""
    return "resp_" + request_id


class StoredResponses:
    def __init__(self, pipeline: Pipeline, owners: Owners) -> None:
        self.p = pipeline
        self.owners = owners

    # ---- POST /v1/responses: name it, pin a follow-up, remember where it was made ----------

    def fields(self, req: Parsed, request_id: str) -> dict[str, Any]:
        """What the body's ``request_id`` becomes (the gateway's, never the client's)."""
        return {"request_id": response_id_for(request_id)}

    async def prepare(self, plan: Plan, req: Parsed) -> None:
        """A follow-up goes to its response's worker; a stored answer is remembered."""
        if plan.kind.shape is not Shape.responses:
            return
        previous = req.body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            owner = await self._owned(previous, plan.ctx.tenant)
            self._pin(plan, previous, owner)
        if req.body.get("store", True) is not False:
            rid = response_id_for(plan.ctx.request_id)
            tenant = plan.ctx.tenant
            thinking = plan.transform.enable_thinking if plan.transform is not None else True

            async def remember(worker: str) -> None:
                await self.owners.remember(rid, Owner(worker, tenant, thinking))

            plan.answered = remember

    async def _owned(self, response_id: str, tenant: str) -> Owner:
        try:
            owner = await self.owners.find(response_id)
        except StoreUnavailable:  # logged with its cause by the store
            raise OwnersUnavailable() from None
        if owner is None or owner.tenant != tenant:
            raise ResponseNotFound(response_id)
        return owner

    def _pin(self, plan: Plan, response_id: str, owner: Owner) -> None:
        worker = self.p.registry.get(owner.worker)
        if worker is None or worker.state not in _HOLDS or worker.model != plan.model.name:
            raise ResponseNotFound(response_id, _GONE)
        plan.pinned = True
        plan.ticket.candidates = [worker.name]
        plan.ticket.prefer_s = 0.0

    # ---- GET / DELETE /v1/responses/{id}, …/cancel, …/input_items ------------------------

    async def handle(self, kind: Kind, incoming: Incoming) -> Reply:
        plan = await self._plan(kind, incoming)
        p = self.p
        principal = incoming.principal
        if principal is None or principal.key is None:
            hold = NO_HOLD
        else:
            hold = await p.key_limits.admit(principal, 0)
        try:
            lease = p.slots.take_now(plan.ticket)
            if lease is None:  # it waits as the pipeline's requests do (``Pipeline._handle``):
                # as its key's, and in its model's queue, the demand that wakes a sleeping worker
                lease = await p.key_requests.wait(principal, p.slots.take(plan.ticket))
        except BaseException:
            await hold.close(0)
            raise
        ex = Exchange(p.deps, plan, lease, hold)
        try:
            if lease.queued_s and incoming.left():  # as ``pipeline._still_wanted``
                raise ClientGone("The client closed the connection while its request waited.")
            return await (p.relay.stream(ex) if plan.stream else p.relay.whole(ex))
        except BaseException as e:
            if isinstance(e, GatewayError) and ex.status == "cancelled":
                ex.status = str(e.status)
            await ex.aclose()
            raise

    async def _plan(self, kind: Kind, incoming: Incoming) -> Plan:
        target = stored_target(incoming.path)
        assert target is not None
        response_id, suffix = target
        req = Parsed({}, b"", None)
        ctx = build_context(incoming, req)
        owner = await self._owned(response_id, ctx.tenant)
        worker = self.p.registry.get(owner.worker)
        if worker is None or worker.state not in _HOLDS:
            raise ResponseNotFound(response_id, _GONE)
        try:
            model = self.p.catalog.resolve(worker.model, incoming.allowed_models())
        except ModelNotFound:
            raise ResponseNotFound(response_id) from None
        query = incoming.query
        stream = kind.method == "GET" and not suffix and _flag(query, "stream")
        path = "/v1/responses/" + quote(response_id, safe="") + suffix
        wait = self.p.cfg.queue.max_wait_s
        if ctx.max_wait_s is not None:  # the client's own bound on its wait, as on every route
            wait = min(wait, ctx.max_wait_s)
        ticket = Ticket(ctx.request_id, model.name, ctx.tenant, ctx.priority, [worker.name],
                        wait, stream)  # fmt: skip
        route = RouteRequest(model.name, 0, True)
        plan = Plan(kind, model, route, b"", stream, ctx, ticket, _split(kind, model, owner))
        plan.method = kind.method
        plan.target = path + ("?" + query.decode("latin-1") if query else "")
        plan.pinned = True
        plan.counts_usage = False  # its usage was counted when it was made
        if kind.method == "DELETE":

            async def forget(_: str) -> None:
                await self.owners.forget(response_id)

            plan.answered = forget
        return plan


def _split(kind: Kind, model: ModelConfig, owner: Owner) -> TransformOptions | None:
    """How a response object read again is split: as its create was, when the gateway splits
    the model's reasoning (the relay fits it to the worker: one with vLLM's parser is never
    split again)."""
    if kind.shape is not Shape.responses or model.reasoning is ReasoningParser.none:
        return None
    opts = TransformOptions.from_request(model, {}).with_thinking(owner.thinking)
    return opts if opts.parser is not None else None


def _flag(query: bytes, name: str) -> bool:
    values = parse_qs(query.decode("latin-1")).get(name) or [""]
    return values[-1].strip().lower() in _TRUE
