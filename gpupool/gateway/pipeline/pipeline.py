"""One request's way through, the same for every token-bearing route.

    read → resolve the model (the key's models only) → context (headers validated) → rewrite
    → media policy and limits → route by window → key limits (rate, concurrency, reserved
    tokens) → admit (a worker slot, or a fair place in the queue) → send (retries before the
    first byte) → relay → account and release (``Exchange.aclose``, run by the front door
    however the reply ends)

No HTTP framework here: the front door hands in the route's :class:`Kind`, the caller
(:class:`Incoming`) and the body, and gets a :class:`Reply` whose ``after`` it must run.
Stages only call forward; the exchange made at admission owns everything taken after it.
"""

from __future__ import annotations

from typing import Any

import orjson

from gpupool.config.models import (
    GpupoolConfig,
    MediaLimits,
    ModelConfig,
    ReasoningField,
    ReasoningParser,
    RevokedStreams,
)
from gpupool.gateway import multimodal
from gpupool.gateway.admission.base import Admission, Lease, Ticket
from gpupool.gateway.catalog import Catalog
from gpupool.gateway.errors import ClientGone, GatewayError
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.kvroute.predict import KvRouting
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.parse import Parsed, ReadLimits, owned_prefix_key
from gpupool.gateway.pipeline.candidates import Candidates
from gpupool.gateway.pipeline.context import build_context
from gpupool.gateway.pipeline.continue_ids import ids_cap
from gpupool.gateway.pipeline.dispatch import Dispatcher
from gpupool.gateway.pipeline.exchange import Context, Exchange, ExchangeDeps, Plan
from gpupool.gateway.pipeline.kinds import Count, Kind, Shape
from gpupool.gateway.pipeline.migrate import Migrator
from gpupool.gateway.pipeline.queued import QueuedStream
from gpupool.gateway.pipeline.relay import Relay, stream_error
from gpupool.gateway.pipeline.slots import Slots
from gpupool.gateway.pipeline.stored import StoredResponses
from gpupool.gateway.reply import SSE, Reply
from gpupool.gateway.routing.policy import Router, RouteRequest
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits import NO_HOLD, Hold, KeyLimits
from gpupool.gateway.security.revoke import KeyRequests
from gpupool.gateway.tenancy.cache import CacheScope
from gpupool.gateway.tenancy.owners import Owners, build_owners
from gpupool.gateway.tenancy.secret import GeneratedSecret
from gpupool.gateway.tokens import exact_count, upper_bound
from gpupool.gateway.transform.chat import TransformOptions, normalize_request_messages
from gpupool.gateway.transform.messages import thinking_switch
from gpupool.gateway.transform.token_ids import FLAG
from gpupool.gateway.upstream.client import DataPath
from gpupool.gateway.upstream.limits import WorkerLimits
from gpupool.workers.registry import Registry, WorkerState

_BYTES_PER_TOKEN = 4  # a prompt's reserved tokens when not counted (the bound is bytes)
_ID_BYTES = 8  # the most a token id takes in vLLM's list of them (six digits and a comma)


class Pipeline:
    def __init__(
        self,
        cfg: GpupoolConfig,
        registry: Registry,
        catalog: Catalog,
        router: Router,
        admission: Admission,
        client: DataPath,
        metrics: Metrics,
        key_limits: KeyLimits,
        *,
        key_requests: KeyRequests | None = None,
        owners: Owners | None = None,
        kv: KvRouting | None = None,
    ) -> None:
        self.cfg = cfg
        self.kv = kv  # precise prefix routing (routing.kv_events)
        # a reload that removes a key refuses its queued requests (``security/revoke.py``)
        self.key_requests = key_requests or KeyRequests(lambda key: True)
        self.registry = registry
        self.catalog = catalog
        self.client = client
        self.key_limits = key_limits
        self.slots = Slots(admission, registry, metrics)
        self.candidates = Candidates(registry, router)
        migrator = Migrator(cfg.routing.migrations, self.candidates, self.slots, metrics)
        self.dispatcher = Dispatcher(
            cfg.routing, registry, self.candidates, client, self.slots, metrics, migrator
        )
        self.relay = Relay(
            self.dispatcher, client, registry, metrics, cfg.server.expose_worker_header,
            WorkerLimits.of(cfg.server).max_event_bytes, migrator,
        )  # fmt: skip
        self.deps = ExchangeDeps(self.slots, registry, router, metrics, kv)
        # the salts' key when the config names none: kept for reloads and replicas, found in
        # its store at start (``Services.start``, ``tenancy/secret.py``)
        self.salt_secret = GeneratedSecret(cfg.queue, cfg.server.state_dir)
        self.cache = CacheScope.from_config(cfg.tenancy, cfg.auth, generated=self.salt_secret.value)
        self.stored = StoredResponses(self, owners or build_owners(cfg.tenancy, cfg.queue))
        s = cfg.server
        self.read_limits = ReadLimits(s.max_json_depth, s.max_n, s.max_sequences,
                                      s.max_json_containers)  # fmt: skip

    async def handle(self, kind: Kind, incoming: Incoming, raw: bytes) -> Reply:
        if kind.stored:  # a stored response's route: its worker, its tenant (``stored.py``)
            return await self.stored.handle(kind, incoming)
        return await self._handle(kind, incoming, raw)

    async def _handle(self, kind: Kind, incoming: Incoming, raw: bytes) -> Reply:
        req = kind.read(raw, self.read_limits)
        model = self.catalog.resolve(req.model, incoming.allowed_models())
        ctx = build_context(incoming, req)
        if self.cache.isolated:  # affinity per tenant, as the cache
            req.prefix_key = owned_prefix_key(req.prefix_key, ctx.tenant)
        media = await self._check_media(req, model) if _may_hold_media(req.raw) else _NO_MEDIA
        route = self._route_by_bound(req, model, media)
        if route is None:
            route = await self._route(kind, req, model, media)
        route = await self._precise(kind, req, ctx, route, media)
        plan = self._plan(kind, req, model, route, ctx, incoming)
        await self.stored.prepare(plan, req)  # /v1/responses: a follow-up's worker, its owner
        principal = incoming.principal
        if principal is None or principal.key is None:
            hold = NO_HOLD  # no key: no key limits to take
        else:
            hold = await self.key_limits.admit(principal, self._reserve(plan, req))
        await self._place_again(plan, hold)
        note = self.slots.swap_note(plan.ticket.model)  # its model asleep: a switch to wait for
        if plan.stream and (ctx.queue_events or (ctx.queue_events is None and note)):
            queued = QueuedStream(plan, hold, self.slots, self.deps, self.relay,
                                  principal, self.key_requests)  # fmt: skip
            return Reply(200, [("content-type", SSE)], stream=queued.events(), after=queued.aclose)
        try:
            lease = self.slots.take_now(plan.ticket)
            if lease is None:  # it waits: as its key's, refused if a reload removes the key
                lease = await self.key_requests.wait(principal, self.slots.take(plan.ticket))
        except BaseException:
            await hold.close(0)
            raise
        ex = Exchange(self.deps, plan, lease, hold)
        try:
            _still_wanted(lease, incoming)
            if not plan.stream:
                return await self.relay.whole(ex)
            return self._cut_when_revoked(await self.relay.stream(ex), ex, principal)
        except BaseException as e:
            if isinstance(e, GatewayError) and ex.status == "cancelled":
                ex.status = str(e.status)
            await ex.aclose()
            raise

    def _cut_when_revoked(self, reply: Reply, ex: Exchange, principal: Principal | None) -> Reply:
        """With ``auth.revoked_streams: cut``, a stream whose key a reload removes ends at its
        next event with the route's error event."""
        key = principal.key if principal is not None else None
        if key is None or reply.stream is None:
            return reply
        if self.cfg.auth.revoked_streams is not RevokedStreams.cut:
            return reply
        reply.stream = self.key_requests.cut_when_revoked(
            key, reply.stream, lambda e: stream_error(ex, e)
        )
        return reply

    # ---- the request as the worker sees it --------------------------------------------------

    def _plan(
        self, kind: Kind, req: Parsed, model: ModelConfig, route: RouteRequest, ctx: Context,
        incoming: Incoming,
    ) -> Plan:  # fmt: skip
        # every stream asks for its usage, so every token is counted; the client sees it only
        # if it asked (``transform/usage.py``)
        strip_usage = req.stream and kind.usage_option and not req.usage_asked
        token_ids = self._token_ids(kind, req)
        body = self._rewrite(kind, req, model, ctx, strip_usage, token_ids > 0)
        decision = self.candidates.decide(route, model.name)
        names = [w.name for w in decision.candidates]
        wait = self.cfg.queue.max_wait_s
        if ctx.max_wait_s is not None:
            wait = min(wait, ctx.max_wait_s)
        ticket = Ticket(ctx.request_id, model.name, ctx.tenant, ctx.priority, names, wait,
                        req.stream, decision.prefer_s)  # fmt: skip
        transform = self._transform(kind, req, model)
        plan = Plan(kind, model, route, body, req.stream, ctx, ticket, transform, strip_usage)
        plan.token_ids = token_ids
        plan.sequences = req.sequences if kind.generates else 0  # bounds the usage it may report
        plan.paced = kind.generates and req.body.get("background") is not True
        gate = self.dispatcher.gate
        if req.stream and gate.min_tokens and len(req.raw) >= gate.min_tokens:  # >= 1 byte a token
            tokens = (
                route.prompt_tokens
                if route.exact
                else self.candidates.router.tokens.tokens(model.name, len(req.raw))
            )
            plan.gated = tokens >= gate.min_tokens
        return plan

    async def _place_again(self, plan: Plan, hold: Hold) -> None:
        """After the key limits awaited, the ticket's candidates ranked again right before the
        slot is taken (no await between unless it fails): a decision sees every request placed
        before it, as its worker's ``inflight`` counts it from ``take_now``. Without key
        limits ``_plan``'s ranking is that already."""
        if hold is NO_HOLD or plan.pinned:
            return
        try:
            decision = self.candidates.decide(plan.route, plan.model.name)
        except BaseException:
            await hold.close(0)
            raise
        plan.ticket.candidates = [w.name for w in decision.candidates]
        plan.ticket.prefer_s = decision.prefer_s

    def _token_ids(self, kind: Kind, req: Parsed) -> int:
        """How many token ids a stream that may move keeps, asked of its worker so a move
        goes on from them (``continue_ids.py``); 0: not asked."""
        if not (req.stream and kind.usage_option and self.cfg.routing.migrations):
            return 0
        # vLLM writes the prompt's ids in the stream's first event: a prompt whose ids could
        # outgrow the event bound the relay reads with (a token is at least a byte of the
        # request, its id at most _ID_BYTES) is not asked (a move goes on from its text)
        if _ID_BYTES * len(req.raw) > self.relay.max_event_bytes:
            return 0
        return ids_cap(req.body, kind.shape is Shape.chat)

    def _rewrite(
        self, kind: Kind, req: Parsed, model: ModelConfig, ctx: Context, usage: bool,
        token_ids: bool = False,
    ) -> bytes:  # fmt: skip
        """The body as the worker must see it; the original bytes when nothing changes.

        The model alias becomes the model's name; assistant history in `reasoning_content`
        is renamed; a body `priority` outside the key's range is clamped; Anthropic's
        `thinking` sets the chat template's switch (``transform/messages.py``); a stream that
        did not ask for its usage chunk asks for it now (its tokens are counted; the relay
        takes it out again), without continuous usage, which vLLM gives only with it. What the
        tenant sets (``_tenant_fields``), and ``return_token_ids`` for a stream that may move
        (``token_ids``), are spliced into the bytes when nothing else changes.
        """
        fields = self._tenant_fields(kind, req, ctx)
        if token_ids:
            fields[FLAG] = True
        body, changed = req.body, False
        if req.model is not None and req.model != model.name:
            body["model"] = model.name
            changed = True
        if kind.count is Count.chat and b"reasoning_content" in req.raw:
            normalize_request_messages(body)
            changed = True
        if req.priority is not None and req.priority != ctx.priority:
            body["priority"] = ctx.priority
            changed = True
        if kind.thinking and model.reasoning is not ReasoningParser.none and "thinking" in body:
            changed = thinking_switch(body, model.reasoning.value) or changed
        if usage:
            opts = body.get("stream_options")
            opts = {k: v for k, v in (opts if isinstance(opts, dict) else {}).items()
                    if k != "continuous_usage_stats"}  # fmt: skip
            body["stream_options"] = {**opts, "include_usage": True}
            changed = True
        if fields and (changed or any(k in body for k in fields)):
            body.update(fields)
            return orjson.dumps(body)
        if fields:
            return _splice(req.raw, fields)
        return orjson.dumps(body) if changed else req.raw

    def _tenant_fields(self, kind: Kind, req: Parsed, ctx: Context) -> dict[str, Any]:
        """The worker's ``cache_salt`` from the tenant (isolated caches), and on
        ``/v1/responses`` the response's id from the gateway's request id (``stored.py``)."""
        fields: dict[str, Any] = {}
        if kind.salted and self.cache.isolated:
            salt = self.cache.salt(ctx.tenant, req.body.get("cache_salt"))
            if salt is not None:
                fields["cache_salt"] = salt
        if kind.shape is Shape.responses:
            fields.update(self.stored.fields(req, ctx.request_id))
        return fields

    async def _precise(
        self, kind: Kind, req: Parsed, ctx: Context, route: RouteRequest,
        media: multimodal.MediaCounts,
    ) -> RouteRequest:  # fmt: skip
        """The route with what each worker's cache holds of the prompt (``kvroute``), where
        KV-event routing is on and the route's prompt is text."""
        if self.kv is None or kind.path not in _PRECISE_PATHS or media is not _NO_MEDIA:
            return route
        # a sleeping worker's cache is gone and its index empty (kvevents/pool.py): a request
        # that waits for its wake is predicted on that, as vLLM will find it (0 cached)
        workers = [w for w in self.registry.serving_of_model(route.model)
                   if w.state is not WorkerState.falling_asleep]  # fmt: skip
        salt = self._salt(kind, req, ctx)
        return await self.kv.predict(route, kind.path, req.body, salt, workers)

    def _salt(self, kind: Kind, req: Parsed, ctx: Context) -> str | None:
        """The ``cache_salt`` the worker will see (the tenant's, with isolated caches)."""
        if kind.salted and self.cache.isolated:
            return self.cache.salt(ctx.tenant, req.body.get("cache_salt"))
        salt = req.body.get("cache_salt")
        return salt if isinstance(salt, str) and salt else None

    def _transform(self, kind: Kind, req: Parsed, model: ModelConfig) -> TransformOptions | None:
        if kind.shape is Shape.none:
            return None
        if kind.shape in (Shape.responses, Shape.messages):  # split only when the gateway must
            if model.reasoning is ReasoningParser.none:
                return None
            opts = TransformOptions.from_request(model, req.body)
            return opts if opts.parser is not None else None
        plain = model.reasoning is ReasoningParser.none and model.reasoning_field is (
            ReasoningField.reasoning
        )
        if plain and b"include_reasoning" not in req.raw:
            return None  # the worker's bytes go through untouched
        opts = TransformOptions.from_request(model, req.body)
        return opts if opts.needs_transform else None

    def _reserve(self, plan: Plan, req: Parsed) -> int:
        """The tokens this request may spend at most, reserved from the key's budget up front
        (settled to the real usage when it ends): its prompt, counted or estimated from its
        bytes (a score or rerank query once per document it is paired with), and every
        sequence's ``max_tokens`` (``auth.tpm_reserve_tokens`` without one)."""
        route = plan.route
        size = len(req.raw) + req.repeated_bytes
        prompt = route.prompt_tokens if route.exact else size // _BYTES_PER_TOKEN
        max_tokens = req.max_tokens if plan.kind.generates else 0
        return self.key_limits.reserve_for(prompt, max_tokens, n=req.sequences)

    # ---- media -----------------------------------------------------------------------------

    async def _check_media(self, req: Parsed, model: ModelConfig) -> multimodal.MediaCounts:
        """Media counts, after every media check (a body ``_may_hold_media``): one walk of the
        body finds every part and source, at any depth (``multimodal.scan``)."""
        found = multimodal.scan(req.body)
        multimodal.check_limits(found.counts, model.limits or self._worker_limits(model))
        multimodal.check_media_policy(found, model)
        urls = found.remote_urls()
        if urls:
            await multimodal.check_remote_hosts(urls)
        return found.counts

    def _worker_limits(self, model: ModelConfig) -> MediaLimits:
        """Without model limits: the most any of the model's workers admits (its launch flags)."""
        caps = [w.media for w in self.registry.of_model(model.name)]

        def most(kind: str) -> int | None:
            values = [getattr(c, kind) for c in caps]
            return None if not values or None in values else max(values)

        return MediaLimits(image=most("image"), video=most("video"), audio=most("audio"))

    # ---- routing by window -----------------------------------------------------------------

    def _route_by_bound(
        self, req: Parsed, model: ModelConfig, media: multimodal.MediaCounts
    ) -> RouteRequest | None:
        """The route when the prompt's byte bound fits every ready window (or none is known):
        nothing to estimate or count. None otherwise (``_route``)."""
        bound = upper_bound(req.raw)
        smallest = 0
        for w in self.registry.ready_of_model(model.name):
            window = w.window
            if window is not None and (not smallest or window < smallest):
                smallest = window
        if smallest and bound >= smallest:
            return None
        return RouteRequest(model.name, bound, False, req.max_tokens, media.image, media.video,
                            media.audio, req.prefix_key)  # fmt: skip

    async def _route(
        self, kind: Kind, req: Parsed, model: ModelConfig, media: multimodal.MediaCounts
    ) -> RouteRequest:
        """The route of a prompt whose bound some window cannot hold: by an estimate, an exact
        count, or the largest window."""
        img, vid, aud = media.image, media.video, media.audio
        bound = upper_bound(req.raw)
        ready = self.registry.ready_of_model(model.name)

        def route(tokens: int, exact: bool) -> RouteRequest:
            return RouteRequest(model.name, tokens, exact, req.max_tokens, img, vid, aud,
                                req.prefix_key)  # fmt: skip

        windows = [w.window for w in ready if w.window is not None]
        # Clear of the window it would go to: route by an estimate and skip the count (a
        # round trip to a worker); a worker's context-length 400 moves it to a larger window.
        tokens = self.candidates.router.tokens  # routing/estimate.py: learned bytes a token
        estimate = tokens.tokens(model.name, len(req.raw))
        target = min((w for w in windows if w > estimate), default=None)
        if target is not None and estimate < self.cfg.routing.exact_count_margin * target:
            return route(estimate, False)
        if kind.count is not Count.none:
            counter = max(ready, key=lambda w: w.window or 0)
            assert counter.url is not None
            chat = kind.count is Count.chat
            n = await exact_count(self.client, counter.url, req.body, model.name, chat)
            if n is not None:
                tokens.learn(model.name, len(req.raw), n)
                if n < max(windows):
                    return route(n, True)
        # Not counted, or counted longer than every window: the largest window tries and vLLM
        # judges, so its 400 is vLLM's own (for a long text it names characters, not tokens;
        # a prompt vLLM truncates may pass). A context-length 400 moves it no further.
        return route(min(bound, max(windows) - 1), False)


_NO_MEDIA = multimodal.MediaCounts(0, 0, 0)
_PRECISE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_may_hold_media = multimodal.may_hold_media


def _splice(raw: bytes, fields: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object holding none of ``fields``) with ``fields`` put first, without
    parsing or writing the rest again."""
    start = raw.index(b"{") + 1
    rest = raw[start:]
    head = orjson.dumps(fields)[1:-1]
    return b"{" + head + (b"," if rest.lstrip()[:1] != b"}" else b"") + rest


def _still_wanted(lease: Lease, incoming: Incoming) -> None:
    """A request that waited for its slot goes only if its client is still there: one client
    leaving frees the slot the next waiter gets, before the loop has read that waiter's own
    close (under load, the closes of clients that left together are read one by one)."""
    if lease.queued_s and incoming.left():
        raise ClientGone("The client closed the connection while its request waited.")
