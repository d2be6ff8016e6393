"""A stream whose worker dies goes on on another worker: the loop every route shares, and the
way of the routes whose answers go on as a completion of vLLM's own rendering (migration).

The relay hands a stream here when migration is on (``Relay._source``)::

    the worker's events ── the route's progress (whole events out, what went out kept)
        │ the worker dies (``UpstreamFailure`` with a cause: ``migrate.py``)
        ▼
    ``migrating``: asks ``go_on`` (chat and completions: ``Relay._continue``; ``/v1/messages``
        and ``/v1/responses``: ``EventMigration._continue``) for a rewriter of the next
        worker's events, or the stream's end, or None (the stream's error, as before)

``EventMigration`` continues a route that vLLM cannot continue itself (its server renders a
generation prompt after a final assistant message, or its events could not simply go on)::

    nothing went out (its head only)  ── the same request again, its events as they come
    the answer's end went out, or every token ── the rest of the end, by the gateway
    an answer the route can continue began ── ``Migrator.move``, then the new worker's
        ``/tokenize`` renders the route's chat messages and the text so far, ``/v1/completions``
        gets the token ids (``CompletionContinuation.send``), the route re-frames its chunks
    anything else (tools, reasoning, images, ...) ── fails as before: the stream's error event

Each route supplies only its conversion and its events (``transform/reframe.Route``):
``transform/messages_continuation.py``, ``transform/responses_continuation.py``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic

import orjson

from gpupool.gateway.errors import GatewayError
from gpupool.gateway.pipeline.continue_completion import CompletionContinuation
from gpupool.gateway.pipeline.dispatch import Dispatcher
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.pipeline.migrate import Migrator
from gpupool.gateway.transform.reframe import P, Rewriter, Route, StreamProgress
from gpupool.gateway.upstream.client import UpstreamFailure
from gpupool.gateway.upstream.limits import over

log = logging.getLogger("gpupool.migrate")

GoOn = Callable[[Exchange, UpstreamFailure], Awaitable[Rewriter | bytes | None]]


async def migrating(
    ex: Exchange, progress: StreamProgress, go_on: GoOn, max_event_bytes: int
) -> AsyncIterator[bytes]:
    """The exchange's stream as it goes out, read by ``progress``; where its worker dies,
    ``go_on`` gives the next worker's rewriter (the stream goes on), the stream's end (bytes),
    or None (the failure is raised: the caller's error event)."""
    resp = ex.resp
    assert resp is not None
    source: Rewriter = progress
    while True:
        try:
            async for chunk in resp.iter_raw():
                out = source.rewrite(chunk)
                if max(progress.pending(), source.pending()) > max_event_bytes:
                    what = f"worker sent an SSE event over {max_event_bytes} bytes"
                    raise over("upstream_max_event_bytes", what)
                yield out
            yield progress.rest()
            return
        except UpstreamFailure as e:
            if progress.done:  # its [DONE] went out: the answer is whole, only its body's end
                return  # broke (the relay ends the stream there)
            moved = await go_on(ex, e)
            if moved is None:
                raise
            progress.rest()  # the dead worker's unended event: the client never gets it
            if isinstance(moved, bytes):
                yield moved  # nothing left to generate: the stream's end
                return
            source = moved
            resp = ex.resp
            assert resp is not None


class EventMigration(Generic[P]):
    """A route's streams, continued as a completion of vLLM's rendering where they break."""

    def __init__(
        self,
        route: Route[P],
        migrator: Migrator,
        dispatcher: Dispatcher,
        completer: CompletionContinuation,
        max_event_bytes: int,
    ) -> None:
        self.route = route
        self.migrator = migrator
        self.dispatcher = dispatcher
        self.completer = completer
        self.max_event_bytes = max_event_bytes

    def stream(self, ex: Exchange) -> AsyncIterator[bytes]:
        """The worker's stream, and where it dies and may move, its continuation."""
        progress = self.route.progress()

        async def go_on(ex: Exchange, e: UpstreamFailure) -> Rewriter | bytes | None:
            return await self._continue(ex, e, progress)

        return migrating(ex, progress, go_on, self.max_event_bytes)

    async def _continue(
        self, ex: Exchange, e: UpstreamFailure, progress: P
    ) -> Rewriter | bytes | None:
        """After ``e``: the next worker's rewriter (the continuation, or the same request
        again: its events read as the first's), the answer's end (bytes), or None: it fails
        as before."""
        m = self.migrator
        cause = m.cause(ex, e)
        if cause is None:
            m.gave_up(ex, e)
            return None
        plan = ex.plan
        if progress.origin is None:
            progress.origin = orjson.loads(plan.body)
        origin = progress.origin
        why = self.route.refusal(origin, progress) if progress.begun else None
        if why is not None:
            m.record(ex, cause, "refused")
            log.warning("request %s: worker %s failed mid-answer (%s); not continued: %s",
                        plan.ctx.request_id, ex.worker, cause, why)  # fmt: skip
            return None
        end = self.route.end(origin, progress) if progress.begun else None
        if end is not None:
            m.record(ex, cause, "ended")
            return end
        if cause == "worker_died" or e.limit is not None:
            self.dispatcher.broke(ex, e)
        sent = progress.tokens
        what = f"continued after {sent} tokens" if progress.begun else "sent again"
        if not await m.move(ex, cause, what):
            return None
        moved = await self._open(ex, origin, progress) if progress.begun else await self._again(ex)
        if isinstance(moved, bytes):
            m.record(ex, cause, "failed")
            log.warning("request %s: continuation on worker %s refused: %s",
                        plan.ctx.request_id, ex.worker, moved[:200])  # fmt: skip
            return None
        m.record(ex, cause, "continued" if progress.begun else "restarted", sent)
        return moved if progress.begun else progress

    async def _again(self, ex: Exchange) -> bytes | None:
        """The same request on the new worker (nothing reached the client): None, or why not."""
        try:
            return await self.dispatcher.send(ex)
        except GatewayError as err:
            return err.message.encode()

    async def _open(self, ex: Exchange, origin: dict[str, object], progress: P) -> Rewriter | bytes:
        """The completion that continues the answer, sent (``ex.resp`` set): its rewriter, or
        why not (the worker's answer or the gateway's words, for the caller's log)."""
        route = self.route

        def body(ids: list[int], room: int) -> dict[str, object] | None:
            return route.body(origin, ids, progress.tokens, room)

        prompt = await self.completer.send(
            ex, route.render(origin), progress.text, body, route.label
        )
        return prompt if isinstance(prompt, bytes) else route.reframer(progress, prompt)
