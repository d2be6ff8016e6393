"""One request's way through: resolve the model, check media, route, admit, send, relay.

No HTTP framework here: the API layer hands in parsed requests and gets a :class:`Reply`.
Retries happen only before the first byte reaches the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson

from gpupool.config.models import (
    GpupoolConfig,
    MediaLimits,
    ModelConfig,
    ReasoningField,
    ReasoningParser,
)
from gpupool.gateway import multimodal
from gpupool.gateway.admission.base import Admission, Lease, Ticket, WaitCallback
from gpupool.gateway.catalog import Catalog
from gpupool.gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    MediaRejected,
    RateLimited,
    UpstreamError,
    UpstreamUnavailable,
)
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.parse import Generate
from gpupool.gateway.relay import Relay, StreamPlan
from gpupool.gateway.reply import SSE, Reply
from gpupool.gateway.routing.policy import Router, RouteRequest
from gpupool.gateway.tokens import exact_count, upper_bound
from gpupool.gateway.transform.chat import TransformOptions, normalize_request_messages
from gpupool.gateway.upstream.client import UpstreamClient, UpstreamFailure, UpstreamResponse
from gpupool.workers.registry import Registry, Worker, WorkerState

_LIVE = (WorkerState.starting, WorkerState.warming, WorkerState.ready)
# vLLM's 400s for a prompt its window cannot hold (too long; or exactly the window, no room left)
_CONTEXT_MARKERS = (b"maximum context length", b"decoder prompt", b"must be at least 1, got 0")
_QUEUED_PROBE_S = 0.05  # a stream not admitted by then is told it is queued
# Bytes that any media part must contain (`\u` covers JSON-escaped spellings of them).
_MEDIA_MARKERS = (b"image", b"video", b"audio", b"\\u")


@dataclass(slots=True)
class Context:
    request_id: str
    tenant: str = "anonymous"
    priority: int = 0
    max_wait_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # prompt + completion, from usage


@dataclass(slots=True)
class Attempt:
    """A request as it is sent: the bytes, where it may go, and what was tried."""

    path: str
    body: bytes
    stream: bool
    model: ModelConfig
    route: RouteRequest
    ticket: Ticket
    tried: set[str] = field(default_factory=set)


class Proxy:
    def __init__(
        self,
        cfg: GpupoolConfig,
        registry: Registry,
        catalog: Catalog,
        router: Router,
        admission: Admission,
        client: UpstreamClient,
        metrics: Metrics,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.catalog = catalog
        self.router = router
        self.admission = admission
        self.client = client
        self.metrics = metrics
        self.relay = Relay(self, metrics)

    # ---- the generate path ----------------------------------------------------------------

    async def generate(self, path: str, req: Generate, ctx: Context) -> Reply:
        model = self.catalog.resolve(req.model)
        body = self._rewrite(req, model)
        media = await self._check_media(req, model)
        route = await self._route_request(req, model, media)
        ticket = self._ticket(ctx, model, route, req.stream)
        attempt = Attempt(path, body, req.stream, model, route, ticket)
        topts = self._transform_opts(req, model)
        plan = StreamPlan(attempt, ctx, topts, time.monotonic())
        if not req.stream:
            lease = await self._acquire(ticket)
            return await self.relay.whole(plan, lease)
        positions: asyncio.Queue[int] = asyncio.Queue()

        async def on_wait(position: int) -> None:
            positions.put_nowait(position)

        task = asyncio.ensure_future(self._acquire(ticket, on_wait))
        try:
            done, _ = await asyncio.wait({task}, timeout=_QUEUED_PROBE_S)
        except asyncio.CancelledError:
            task.cancel()  # the client left: the waiter goes, or its fresh lease is returned
            task.add_done_callback(self._release_orphan)
            raise
        if done:
            return await self.relay.stream(plan, task.result())
        stream = self.relay.queued(plan, task, positions)
        return Reply(200, [("content-type", SSE)], stream=stream)

    def _rewrite(self, req: Generate, model: ModelConfig) -> bytes:
        """The body as the worker must see it; the original bytes when nothing changes."""
        changed = False
        if req.model is not None and req.model != model.name:
            req.body["model"] = model.name
            changed = True
        if req.chat and b"reasoning_content" in req.raw:
            normalize_request_messages(req.body)
            changed = True
        return orjson.dumps(req.body) if changed else req.raw

    async def _check_media(self, req: Generate, model: ModelConfig) -> multimodal.MediaCounts:
        """Media counts (zero without any media marker in the bytes), after every media check."""
        if not any(m in req.raw for m in _MEDIA_MARKERS):
            return multimodal.MediaCounts(0, 0, 0)
        counts = multimodal.count_media(req.body)
        multimodal.check_limits(counts, model.limits or self._worker_limits(model))
        multimodal.check_media_policy(req.body, model)
        urls = multimodal.extract_remote_urls(req.body)
        if urls:
            await multimodal.check_remote_hosts(urls)
        return counts

    def _worker_limits(self, model: ModelConfig) -> MediaLimits:
        """Without model limits: the most any of the model's workers admits (its launch flags)."""
        caps = [w.media for w in self.registry.of_model(model.name)]

        def most(kind: str) -> int | None:
            values = [getattr(c, kind) for c in caps]
            return None if not values or None in values else max(values)

        return MediaLimits(image=most("image"), video=most("video"), audio=most("audio"))

    def _transform_opts(self, req: Generate, model: ModelConfig) -> TransformOptions | None:
        if not req.chat:
            return None
        plain = model.reasoning is ReasoningParser.none and model.reasoning_field is (
            ReasoningField.reasoning
        )
        if plain and b"include_reasoning" not in req.raw:
            return None  # the worker's bytes go through untouched
        opts = TransformOptions.from_request(model, req.body)
        return opts if opts.needs_transform else None

    def _ticket(self, ctx: Context, model: ModelConfig, route: RouteRequest, s: bool) -> Ticket:
        names = [w.name for w in self._candidates(route, model)]
        wait = self.cfg.queue.max_wait_s
        if ctx.max_wait_s is not None:
            wait = min(wait, ctx.max_wait_s)
        return Ticket(ctx.request_id, model.name, ctx.tenant, ctx.priority, names, wait, s)

    # ---- routing ----------------------------------------------------------------------------

    async def _route_request(
        self, req: Generate, model: ModelConfig, media: multimodal.MediaCounts
    ) -> RouteRequest:
        img, vid, aud = media.image, media.video, media.audio
        bound = upper_bound(req.raw)
        route = RouteRequest(model.name, bound, False, req.max_tokens, img, vid, aud,
                             req.prefix_key)  # fmt: skip
        ready = self.registry.ready_of_model(model.name)
        windows = [w.window for w in ready if w.window is not None]
        if not windows or bound < min(windows):
            return route
        counter = max(ready, key=lambda w: w.window or 0)
        assert counter.url is not None
        n = await exact_count(self.client, counter.url, req.body, model.name, req.chat)
        if n is None:
            return route
        return RouteRequest(model.name, n, True, req.max_tokens, img, vid, aud, req.prefix_key)

    def _candidates(self, route: RouteRequest, model: ModelConfig) -> list[Worker]:
        live = [w for w in self.registry.of_model(model.name) if w.state in _LIVE]
        if not live:
            raise UpstreamUnavailable(f"No worker for model `{model.name}` is available.")
        decision = self.router.decide(route, live)
        if decision.candidates:
            return decision.candidates
        if decision.media_refused:
            raise MediaRejected(
                f"No worker of model `{model.name}` accepts {route.image} image(s), "
                f"{route.video} video(s) and {route.audio} audio item(s) in one prompt.",
                param="messages",
            )
        window = decision.too_long_for or 0
        raise ContextLengthExceeded(window, min(route.prompt_tokens, window + 1))

    # ---- admission and dispatch ----------------------------------------------------------

    async def _acquire(self, ticket: Ticket, on_wait: WaitCallback | None = None) -> Lease:
        if not ticket.candidates:
            raise UpstreamUnavailable(f"No worker for model `{ticket.model}` is available.")
        try:
            lease = await self.admission.acquire(ticket, on_wait)
        except RateLimited as e:
            self.metrics.admission.labels(ticket.model, "rejected", type(e).__name__).inc()
            raise
        decision = "queued" if lease.queued_s > 0 else "immediate"
        self.metrics.admission.labels(ticket.model, decision, "").inc()
        self.metrics.queue_wait.labels(ticket.model).observe(lease.queued_s)
        w = self.registry.get(lease.worker)
        if w is not None:
            w.inflight += 1
            w.requests_total += 1
        return lease

    def _release_orphan(self, task: asyncio.Future[Lease]) -> None:
        if not task.cancelled() and task.exception() is None:
            self.relay.soon(self.release(task.result()))

    async def release(self, lease: Lease) -> None:
        if lease.extra.get("released"):
            return
        lease.extra["released"] = True
        w = self.registry.get(lease.worker)
        if w is not None:
            w.inflight = max(0, w.inflight - 1)
        await self.admission.release(lease)

    async def dispatch(
        self, a: Attempt, lease: Lease, ctx: Context
    ) -> tuple[UpstreamResponse, Lease, bytes | None]:
        """Send, retrying on another worker before any byte went back to the client.

        Returns the response, the lease it runs under, and the body when it had to be read
        (an error that is passed through). Releases the lease itself only when it raises.
        """
        while True:
            worker = self.registry.get(lease.worker)
            try:
                if worker is None or worker.url is None:
                    raise UpstreamFailure("worker went away", sent=False)
                resp = await self.client.open("POST", worker.url + a.path, a.body, ctx.headers)
                if resp.status < 400:
                    return resp, lease, None
                data = await resp.read()
            except UpstreamFailure as e:
                if e.sent and not (e.died and worker is not None and worker.routable):
                    await self.release(lease)
                    if worker is not None:
                        self.note_failure(worker, str(e))
                    msg = f"The worker failed while handling the request ({e})."
                    raise UpstreamError(msg) from None
                lease = await self._retry(a, lease, e.args[0], worker)
                continue
            except BaseException:
                await self.release(lease)
                raise
            retry_reason = self._retryable(resp.status, data, worker, a)
            if retry_reason is None or len(a.tried) >= self.cfg.routing.retries:
                return resp, lease, data
            failure = retry_reason != "context_length"
            lease = await self._retry(a, lease, retry_reason, worker, failure=failure)

    def _retryable(self, status: int, data: bytes, worker: Worker, a: Attempt) -> str | None:
        if status >= 500:
            return f"status {status}"
        if status == 400 and any(m in data for m in _CONTEXT_MARKERS):
            a.route = RouteRequest(
                a.route.model, max(a.route.prompt_tokens, (worker.window or 0)), True,
                a.route.max_tokens, a.route.image, a.route.video, a.route.audio,
                a.route.prefix_key,
            )  # fmt: skip
            return "context_length"
        return None

    async def _retry(
        self,
        a: Attempt,
        lease: Lease,
        reason: str,
        worker: Worker | None,
        failure: bool = True,
    ) -> Lease:
        await self.release(lease)
        a.tried.add(lease.worker)
        if worker is not None and failure:
            self.note_failure(worker, reason)
        if worker is not None:
            self.metrics.retries.labels(worker.model, worker.name, reason.split()[0]).inc()
        if len(a.tried) > self.cfg.routing.retries:
            raise UpstreamError("The worker failed and retries are exhausted.")
        try:
            remaining = [w.name for w in self._candidates(a.route, a.model)
                         if w.name not in a.tried]  # fmt: skip
        except GatewayError:
            remaining = []
        if not remaining:
            raise UpstreamUnavailable("The worker failed and no other worker can take it.")
        a.ticket.candidates = remaining
        return await self._acquire(a.ticket)

    def note_failure(self, worker: Worker, reason: str) -> None:
        """A request could not reach a worker: count it; repeated failures take it out."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        self.metrics.errors.labels(worker.model, worker.name, "upstream").inc()
        if (
            worker.consecutive_failures >= self.cfg.routing.fail_threshold
            and worker.state is WorkerState.ready
            and not worker.supervised
        ):
            self.registry.transition(worker, WorkerState.failed)

    # ---- pass-through routes ------------------------------------------------------------

    async def passthrough(
        self, method: str, path: str, raw: bytes, model_name: str | None, ctx: Context
    ) -> Reply:
        model = self.catalog.resolve(model_name)
        if model_name is not None and model_name != model.name:
            body = orjson.loads(raw)
            body["model"] = model.name
            raw = orjson.dumps(body)
        ready = sorted(self.registry.ready_of_model(model.name), key=lambda w: w.load)
        if not ready or ready[0].url is None:
            raise UpstreamUnavailable(f"No worker for model `{model.name}` is available.")
        w = ready[0]
        try:
            resp = await self.client.open(method, f"{w.url}{path}", raw, ctx.headers)
        except UpstreamFailure as e:
            self.note_failure(w, str(e))
            raise UpstreamError(f"The worker could not be reached ({e}).") from None
        if resp.content_type.startswith(SSE):
            return Reply(resp.status, resp.headers, stream=self._raw(resp))
        return Reply(resp.status, resp.headers, await resp.read())

    async def _raw(self, resp: UpstreamResponse) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.iter_raw():
                yield chunk
        except UpstreamFailure as e:
            yield UpstreamError(f"The worker failed mid-stream: {e}.").sse_event()
        finally:
            resp.close()
