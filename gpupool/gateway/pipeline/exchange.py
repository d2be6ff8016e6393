"""One admitted request and everything it holds, released in one place.

An :class:`Exchange` is made the moment a request owns a worker slot (and its key's hold). It
owns the slot (the lease follows retries to other workers), the key's hold (concurrency slot
and reserved tokens), and the worker's response. :meth:`Exchange.aclose` is the only place
that returns them, settles the key's tokens from the usage seen, closes the worker connection
and records the request's metrics. The front door calls it once the reply is written, failed
or abandoned (``Reply.after``), so no exit skips it: an error, a client that resets while we
are blocked writing, a stream generator that never started.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson

from gpupool.config.models import ModelConfig
from gpupool.gateway.admission.base import Lease, Ticket
from gpupool.gateway.kvroute.predict import observe
from gpupool.gateway.routing.policy import RouteRequest
from gpupool.gateway.transform.chat import TransformOptions

if TYPE_CHECKING:
    from gpupool.gateway.kvroute.predict import KvRouting
    from gpupool.gateway.metrics import Metrics
    from gpupool.gateway.pipeline.kinds import Kind
    from gpupool.gateway.pipeline.prefill import Turn
    from gpupool.gateway.pipeline.slots import Slots
    from gpupool.gateway.routing.policy import Router
    from gpupool.gateway.security.limits import Hold
    from gpupool.gateway.upstream.client import Response
    from gpupool.workers.registry import Registry

# The way vLLM writes usage, read without parsing the body (the usual case: the same numbers a
# JSON parser reads, as written compactly); anything else is read by orjson
_VLLM_USAGE = re.compile(
    rb'"usage":\{"prompt_tokens":(\d+),"total_tokens":\d+,"completion_tokens":(\d+)'
)
_CACHED = re.compile(rb'"prompt_tokens_details":\{"cached_tokens":(\d+)')


@dataclass(slots=True)
class Context:
    """Who asks, and how: from the request's headers (``pipeline/context.py``)."""

    request_id: str
    tenant: str = "anonymous"
    priority: int = 0
    max_wait_s: float | None = None
    headers: bytes = b""  # the header lines a worker sees (``name: value\r\n`` each)
    # a queued stream wants its `: queued` comments (opt-in; None: not said, which a stream
    # waiting for a swap group's switch takes as yes)
    queue_events: bool | None = None


@dataclass(slots=True)
class Plan:
    """A request as it is sent: the bytes, where they may go, how the answer is reshaped."""

    kind: Kind
    model: ModelConfig
    route: RouteRequest
    body: bytes
    stream: bool
    ctx: Context
    ticket: Ticket
    transform: TransformOptions | None = None
    strip_usage: bool = False  # the gateway asked the worker for a usage chunk the client did not
    # the gateway asked the worker for its token ids (a stream that may move: continue_ids.py),
    # keeping at most this many; 0: not asked
    token_ids: int = 0
    gated: bool = False  # a long streamed prompt: prefilled one at a time per worker (prefill.py)
    tried: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    method: str = "POST"
    target: str = ""  # the worker's path (and query) when not the kind's own
    pinned: bool = False  # only its ticket's worker holds what it needs (a stored response)
    answered: Callable[[str], Awaitable[None]] | None = None  # the worker accepted it (< 400)
    sequences: int = 1  # sequences it may generate (n x prompts; 0: none, embeddings)
    # its time is a sample of the worker's pace (``routing/pace.py``): it generates, here and now;
    # not a stored response's GET/cancel (its usage is the stored one's) nor a background create
    # (answered at once, generated later)
    paced: bool = False
    # its answer's usage is tokens used now: not a stored response read again (a GET, its
    # events, cancel, input items), whose usage was counted, and charged, when it was made
    counts_usage: bool = True
    migrations: int = 0  # times it moved to another worker after its answer began (migrate.py)
    migration_failed: bool = False  # counted as a failed migration once (migrate.py)


class Exchange:
    __slots__ = ("_closed", "_deps", "answered", "cached", "completion", "hold", "lease", "plan",
                 "prompt", "resp", "status", "turn", "usage_body")  # fmt: skip

    def __init__(self, deps: ExchangeDeps, plan: Plan, lease: Lease, hold: Hold) -> None:
        self._deps = deps
        self.plan = plan
        self.lease = lease
        self.hold = hold
        self.resp: Response | None = None
        # a worker took it (a status below 400): its tokens count from then on, even when it
        # later moves and fails (``migrate.py`` drops ``resp`` then)
        self.answered = False
        self.status: str = "cancelled"  # until the relay knows better
        self.prompt = 0
        self.completion = 0
        self.usage_body: bytes | None = None  # a body passed on untouched: usage read at close
        self.turn: Turn | None = None  # its long prefill's hold on the worker (``prefill.py``)
        self.cached: int | None = None  # vLLM's prompt_tokens_details.cached_tokens, when sent
        self._closed = False
        if deps.kv is not None and plan.route.kv is not None:
            deps.kv.placed(plan.route, lease.worker)  # its blocks count there at once

    @property
    def worker(self) -> str:
        return self.lease.worker

    def prefilled(self) -> None:
        """Its prefill is over (a first event, an error, a retry, the end): the next long
        prompt for its worker may go."""
        turn = self.turn
        if turn is not None:
            self.turn = None
            turn.end()

    def note_usage(self, usage: object) -> None:
        """Tokens from a usage object (OpenAI's or Anthropic/Responses' names); the largest
        seen wins, so cumulative and final usage chunks both count once. Only non-negative
        integers count (a worker is only semi-trusted: see ``note_counts``)."""
        if not isinstance(usage, dict):
            return
        p = usage.get("prompt_tokens", usage.get("input_tokens"))
        c = usage.get("completion_tokens", usage.get("output_tokens"))
        self.note_counts(_count(p), _count(c))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
            self.cached = details["cached_tokens"]

    def note_body(self, data: bytes) -> None:
        """Read the ``usage`` object of a body that passed through untouched."""
        start = data.rfind(b'"usage":{')
        if start >= 0 and (plain := _VLLM_USAGE.match(data, start)) is not None:
            self.note_counts(int(plain[1]), int(plain[2]))
            if self.plan.route.kv is not None and (hit := _CACHED.search(data, start)):
                self.cached = int(hit[1])
        elif b'"usage"' in data:  # written some other way: read as JSON is read
            with contextlib.suppress(orjson.JSONDecodeError):
                obj = orjson.loads(data)
                if isinstance(obj, dict):
                    self.note_usage(obj.get("usage"))

    def note_counts(self, prompt: int, completion: int) -> None:
        """Keep the largest counts seen, each clamped to what the request could produce: a
        prompt within its worker's window per sequence, a completion within ``max_tokens`` (or
        the window) per sequence. A worker's usage of 10^30 tokens charges the key no more.
        A stored response read again counts none (``Plan.counts_usage``)."""
        if not self.plan.counts_usage:
            return
        most_prompt, most_completion = self._bounds()
        prompt = min(prompt, most_prompt)
        completion = min(completion, most_completion)
        if prompt > self.prompt:
            self.prompt = prompt
        if completion > self.completion:
            self.completion = completion

    def _bounds(self) -> tuple[int, int]:
        plan = self.plan
        worker = self._deps.registry.get(self.lease.worker)
        window = (worker.window if worker is not None else None) or _NO_WINDOW
        seqs = max(plan.sequences, 1)
        completion = min(plan.route.max_tokens or window, window) if plan.sequences else 0
        return window * seqs, completion * seqs

    @property
    def tokens(self) -> int | None:
        """Tokens used, or None when no usage was seen (the reservation then stands)."""
        total = self.prompt + self.completion
        return total if total else None

    async def aclose(self) -> None:
        """Release, settle, close and record: once, whatever happened before."""
        if self._closed:
            return
        self._closed = True
        if self.turn is not None:
            self.prefilled()
        try:
            if self.resp is not None:
                self.resp.close()
            if self.usage_body is not None:
                self.note_body(self.usage_body)
            self._record()
        finally:
            try:
                slots = self._deps.slots
                if not slots.give_now(self.lease):
                    await slots.give(self.lease)
            finally:
                if self.hold.limits is not None:
                    await self.hold.close(self._used())

    def _used(self) -> int | None:
        """Tokens to charge: none when no worker ever answered or it ends in a worker's error;
        the usage seen otherwise; None (the reservation stands) when it worked but said nothing,
        as a stream cut before its usage chunk, moved or not (a move that finds no worker
        charges as the same cut without migration)."""
        if not self.answered or (self.status.isdigit() and self.status != "200"):
            return 0
        return self.tokens

    def _record(self) -> None:
        d, plan, worker = self._deps, self.plan, self.lease.worker
        elapsed = time.monotonic() - plan.started
        d.metrics.served(plan.model.name, worker).record(
            self.status, elapsed, self.prompt, self.completion
        )
        if self.status == "200":
            # the worker's own time (not the queue's); a retried request is no clean sample
            took = 0.0 if plan.tried or not plan.paced else elapsed - self.lease.queued_s
            d.router.served(plan.route, worker, took, self.completion)
            d.registry.succeeded(worker)
            if d.kv is not None and self.cached is not None:
                observe(d.kv, plan.route, worker, self.prompt, self.cached, plan.migrations > 0)


_NO_WINDOW = 1 << 24  # tokens: a worker whose window is unknown (no model's is this large)


def _count(v: object) -> int:
    """A token count as a worker reported it: a non-negative integer, else 0."""
    return v if type(v) is int and v > 0 else 0


@dataclass(slots=True)
class ExchangeDeps:
    """What an exchange reports to when it closes."""

    slots: Slots
    registry: Registry
    router: Router
    metrics: Metrics
    kv: KvRouting | None = None  # precise prefix routing: placements and vLLM's cached_tokens
