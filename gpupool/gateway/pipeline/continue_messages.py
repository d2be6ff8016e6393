"""A streamed ``/v1/messages`` answer whose worker dies goes on on another (migration).

The relay hands a Messages stream here when migration is on (``Relay._raw``)::

    the worker's Anthropic events ── MessagesProgress (whole events out, what went out kept)
        │ the worker dies (``UpstreamFailure`` with a cause: ``migrate.py``)
        ▼
    nothing went out (its head only)  ── the same request again, its events as they come
    the message's end went out, or every token ── the rest of the end, by the gateway
    a text-only answer began ── ``Migrator.move``, then the new worker's ``/tokenize`` renders
        the adapter's chat messages (``transform/messages_continuation.py``) and the text so
        far, ``/v1/completions`` gets the token ids, ``AsMessages`` re-frames its chunks
    anything else (tools, thinking, images, ...) ── fails as before: the stream's error event

vLLM's adapter cannot continue a final assistant message (docs/migration.md, "Responses and
Messages"), hence the completion of its own rendering.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gpupool.gateway.errors import GatewayError
from gpupool.gateway.pipeline.continue_completion import CompletionContinuation
from gpupool.gateway.pipeline.dispatch import Dispatcher
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.pipeline.migrate import Migrator
from gpupool.gateway.transform.messages_continuation import (
    AsMessages,
    MessagesProgress,
    chat_messages,
    completion_body,
    messages_refusal,
)
from gpupool.gateway.upstream.client import UpstreamFailure
from gpupool.gateway.upstream.limits import over
from gpupool.workers.registry import Registry

Json = dict[str, Any]
log = logging.getLogger("gpupool.migrate")


class MessagesMigration:
    def __init__(
        self,
        migrator: Migrator,
        dispatcher: Dispatcher,
        completer: CompletionContinuation,
        registry: Registry,
        max_event_bytes: int,
    ) -> None:
        self.migrator = migrator
        self.dispatcher = dispatcher
        self.completer = completer
        self.registry = registry
        self.max_event_bytes = max_event_bytes

    async def stream(self, ex: Exchange) -> AsyncIterator[bytes]:
        """The worker's Messages stream, and where it dies and may move, its continuation."""
        resp = ex.resp
        assert resp is not None
        progress = MessagesProgress()
        resume: AsMessages | None = None
        while True:
            try:
                async for chunk in resp.iter_raw():
                    out = progress.feed(chunk) if resume is None else resume.rewrite(chunk)
                    if max(progress.pending(), resume.pending() if resume else 0) > (
                        self.max_event_bytes
                    ):
                        cap = self.max_event_bytes
                        raise over("upstream_max_event_bytes",
                                   f"worker sent an SSE event over {cap} bytes")  # fmt: skip
                    yield out
                yield progress.rest()
                return
            except UpstreamFailure as e:
                moved = await self._continue(ex, e, progress)
                if moved is None:
                    raise
                progress.rest()  # the dead worker's unended event: the client never gets it
                if isinstance(moved, bytes):
                    yield moved  # nothing left to generate: the message's end
                    return
                resume = moved if isinstance(moved, AsMessages) else None
                resp = ex.resp
                assert resp is not None

    async def _continue(
        self, ex: Exchange, e: UpstreamFailure, progress: MessagesProgress
    ) -> AsMessages | bytes | bool | None:
        """After ``e``: the continuation's rewriter, True (the same request sent again: its
        events pass as they come), the message's end (bytes), or None: it fails as before."""
        m = self.migrator
        cause = m.cause(ex, e)
        if cause is None:
            m.gave_up(ex, e)
            return None
        plan = ex.plan
        if progress.origin is None:
            progress.origin = orjson.loads(plan.body)
        origin = progress.origin
        why = (messages_refusal(origin) or progress.broken) if progress.begun else None
        if why is not None:
            m.record(ex, cause, "refused")
            log.warning("request %s: worker %s failed mid-answer (%s); not continued: %s",
                        plan.ctx.request_id, ex.worker, cause, why)  # fmt: skip
            return None
        limit = origin.get("max_tokens")
        if progress.finished or (isinstance(limit, int) and progress.tokens >= limit):
            m.record(ex, cause, "ended")
            usage = {"input_tokens": progress.input_tokens or 0, "output_tokens": progress.tokens}
            return progress.end(("max_tokens", None), usage)
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
        return moved

    async def _again(self, ex: Exchange) -> bool | bytes:
        """The same request on the new worker (nothing reached the client)."""
        try:
            data = await self.dispatcher.send(ex)
        except GatewayError as err:
            data = err.message.encode()
        return True if data is None else data

    async def _open(
        self, ex: Exchange, origin: Json, progress: MessagesProgress
    ) -> AsMessages | bytes:
        """The completion that continues the answer, sent (``ex.resp`` set): its rewriter, or
        why not (the worker's answer or the gateway's words, for the caller's log)."""
        plan = ex.plan
        model = plan.model.name
        worker = self.registry.get(ex.worker)
        if worker is None or worker.url is None:
            return b"the worker is gone"
        render = {"model": model, "messages": chat_messages(origin), "add_generation_prompt": True}
        if origin.get("chat_template_kwargs"):
            render["chat_template_kwargs"] = origin["chat_template_kwargs"]
        rendered = await self.completer.ids(worker.url, render)
        answer = {"model": model, "prompt": progress.text, "add_special_tokens": False}
        partial = await self.completer.ids(worker.url, answer)
        if rendered is None or partial is None:
            return b"the worker's /tokenize could not render the prompt"
        ids, window = rendered[0] + partial[0], rendered[1] or worker.window or 0
        body = completion_body(origin, ids, progress.tokens, window - len(ids))
        if body is None:
            return b"no room left in the window"
        kept, plan.body, plan.target = plan.body, orjson.dumps(body), "/v1/completions"
        try:
            data = await self.dispatcher.send(ex)
        except GatewayError as err:
            data = err.message.encode()
        finally:
            plan.body, plan.target = kept, ""  # a further move continues from the Messages request
        if data is not None:
            return data
        log.warning("request %s: continued on worker %s as a completion of %d prompt and %d "
                    "answer tokens (a /v1/messages answer)",
                    plan.ctx.request_id, ex.worker, len(rendered[0]), len(partial[0]))  # fmt: skip
        return AsMessages(progress, len(rendered[0]))
