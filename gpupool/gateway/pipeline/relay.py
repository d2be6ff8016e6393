"""Relaying a worker's answer to the client: whole bodies and SSE streams.

Bytes pass through untouched unless something must change: a reasoning split or rename (the
events are parsed and re-framed), or a usage chunk the gateway asked for on the client's behalf
(dropped again). A stream never ends silently: a chat or completions stream whose worker dies
goes on on another worker where it may (``_raw``, ``migrate.py``); otherwise it ends with
vLLM's in-stream error event and ``data: [DONE]``. Nothing here releases anything: every reply's
``after`` is its exchange's ``aclose``, which the front door runs however the reply ends.

What a worker sends is bounded (``upstream/limits.py``): the connection bounds heads, bodies and
time; here, an SSE event the gateway must buffer (to reshape a stream, or to read a usage line
split across reads) is bounded by ``max_event_bytes``. A worker past a bound fails the request
(502, or the stream's error event), is counted as failed and logged by name (``Dispatcher.broke``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson

from gpupool.gateway.errors import GatewayError, UpstreamError
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.continue_completion import (
    CompletionContinuation,
    cut,
    refused,
    text_only,
)
from gpupool.gateway.pipeline.continue_events import EventMigration, migrating
from gpupool.gateway.pipeline.continue_ids import IdsContinuation
from gpupool.gateway.pipeline.dispatch import Dispatcher, failure_error
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.pipeline.kinds import Shape
from gpupool.gateway.pipeline.migrate import Migrator
from gpupool.gateway.pipeline.peek import budget_refused, may_refuse_budget
from gpupool.gateway.reply import Reply
from gpupool.gateway.tokens import exact_count, tokenize_count
from gpupool.gateway.transform.chat import (
    ChatStreamTransformer,
    TransformOptions,
    all_reasoning,
    chat_reasoning_texts,
    reasoning_token_count,
    transform_chat_response,
)
from gpupool.gateway.transform.continuation import (
    Progress,
    Resume,
    continuation,
    end_events,
    refusal,
)
from gpupool.gateway.transform.messages import (
    MessagesStreamTransformer,
    budget_refusal,
    transform_messages_body,
)
from gpupool.gateway.transform.messages_continuation import MESSAGES
from gpupool.gateway.transform.responses import (
    ResponsesStreamTransformer,
    only_reasoning,
    transform_responses_body,
)
from gpupool.gateway.transform.responses import reasoning_texts as responses_reasoning
from gpupool.gateway.transform.responses_continuation import RESPONSES
from gpupool.gateway.transform.sse import EventBuffer
from gpupool.gateway.transform.token_ids import FLAG, TokenIds
from gpupool.gateway.transform.usage import UsageStrip, plain
from gpupool.gateway.upstream.client import DataPath, Response, UpstreamFailure
from gpupool.gateway.upstream.limits import WorkerLimits, over
from gpupool.workers.registry import Registry

log = logging.getLogger("gpupool.upstream")

_DONE = b"data: [DONE]\n\n"
_EVENT_SHAPES = (Shape.responses, Shape.messages)  # `event:`/`data:` streams, reshaped whole
_FINAL = ("response.completed", "response.incomplete")  # a Responses stream's usage


class EventTransformer(Protocol):
    """Reshapes an ``event:``/``data:`` stream (``transform/responses.py``, ``messages.py``)."""

    def feed(self, event_type: str, obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]: ...

    def finish(self) -> list[tuple[str, dict[str, Any]]]: ...


class Relay:
    def __init__(
        self,
        dispatcher: Dispatcher,
        client: DataPath,
        registry: Registry,
        metrics: Metrics,
        worker_header: bool,
        max_event_bytes: int = WorkerLimits().max_event_bytes,
        migrator: Migrator | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.migrator = migrator
        self.client = client
        self.registry = registry
        self.metrics = metrics
        self.worker_header = worker_header
        self.max_event_bytes = max_event_bytes
        self.completer = CompletionContinuation(dispatcher, client, registry)
        self.by_ids = IdsContinuation(dispatcher, registry)
        self.moving: dict[Shape, EventMigration[Any]] = {}  # routes continued as completions
        if migrator is not None:
            for shape, route in ((Shape.messages, MESSAGES), (Shape.responses, RESPONSES)):
                self.moving[shape] = EventMigration(
                    route, migrator, dispatcher, self.completer, max_event_bytes
                )

    def _headers(self, resp: Response, ex: Exchange) -> list[tuple[str, str]]:
        if self.worker_header:
            return [*resp.headers, ("x-gpupool-worker", ex.worker)]
        return resp.headers

    async def open(self, ex: Exchange) -> bytes | None:
        """Send ``ex`` (retries included; ``ex.resp`` is set) and fit its transform to the
        worker it landed on. Returns the body when it had to be read (an error passed on)."""
        data = await self.dispatcher.send(ex)
        if ex.plan.transform is not None:
            self.fit(ex)
        if data is not None and ex.resp is not None and ex.resp.status == 400:
            data = self._refused(ex, data)
        return data

    def fit(self, ex: Exchange) -> None:
        """A worker that runs vLLM's reasoning parser is never split again."""
        opts = ex.plan.transform
        w = self.registry.get(ex.worker)
        if opts is not None and w is not None and w.reasoning_parser is not None:
            opts = opts.for_worker(w.reasoning_parser)
            ex.plan.transform = opts if opts.needs_transform else None

    # ---- whole bodies ----------------------------------------------------------------------

    async def whole(self, ex: Exchange) -> Reply:
        resp, data = await self._read_whole(ex)
        if resp.status == 200 and not _same_model(data, ex.plan.model.name):
            ex.status = "upstream_error"
            other = over("model", "worker answered for another model")
            self._broke(ex, other)
            raise failure_error(other, "before answering")
        ex.status = str(resp.status)
        if resp.status == 200 and ex.plan.transform is not None:
            data = await self._finish_body(ex, data)
        elif resp.status == 200:
            ex.usage_body = data  # its usage is read after the client has its answer
        elif resp.status == 400:
            data = self._refused(ex, data)
        return Reply(resp.status, self._headers(resp, ex), data, after=ex.aclose)

    async def _read_whole(self, ex: Exchange) -> tuple[Response, bytes]:
        """Send ``ex`` (``open``, written out) and read its whole answer; a worker that dies
        before the body is whole sends it again elsewhere when it may move."""
        while True:
            data = await self.dispatcher.send(ex)
            if ex.plan.transform is not None:
                self.fit(ex)
            resp = ex.resp
            assert resp is not None
            try:
                if data is None:
                    data = resp.read_now()
                if data is None:
                    data = await resp.read()
                return resp, data
            except UpstreamFailure as e:
                if not await self._send_again(ex, e):
                    ex.status = "upstream_error"
                    self._broke(ex, e)
                    raise failure_error(e, "before answering") from None

    async def _send_again(self, ex: Exchange, e: UpstreamFailure) -> bool:
        """A whole answer whose worker died mid-body starts again elsewhere (``migrate.py``):
        nothing reached the client, and the text so far is only in the lost body."""
        m = self.migrator
        cause = m.cause(ex, e) if m is not None else None
        if m is None or cause is None:
            if m is not None:
                m.gave_up(ex, e)
            return False
        if cause == "worker_died" or e.limit is not None:
            self.dispatcher.broke(ex, e)
        if not await m.move(ex, cause, "sent again"):
            return False
        m.record(ex, cause, "restarted")
        return True

    @staticmethod
    def _refused(ex: Exchange, data: bytes) -> bytes:
        """A worker's 400 for what only the gateway's split made impossible, in its words."""
        if ex.plan.kind.shape is Shape.messages and ex.plan.transform is not None:
            return budget_refusal(ex.plan.model.name, data) or data
        return data

    async def _finish_body(self, ex: Exchange, data: bytes) -> bytes:
        """A 200 body the gateway must rewrite (reasoning split or renamed); usage read too."""
        opts = ex.plan.transform
        assert opts is not None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if not isinstance(obj, dict):
            return data
        ex.note_usage(obj.get("usage"))
        if ex.plan.kind.shape is Shape.messages:
            return orjson.dumps(transform_messages_body(obj, opts))
        if ex.plan.kind.shape is Shape.responses:
            return orjson.dumps(await self._finish_response(ex, obj, opts))
        out = transform_chat_response(obj, opts)
        if opts.parser is not None:  # the gateway split, so vLLM could not count
            texts = chat_reasoning_texts(obj, opts)
            await self._add_reasoning_tokens(out, texts, ex, all_reasoning(out))
        return orjson.dumps(out)

    async def _finish_response(
        self, ex: Exchange, obj: dict[str, Any], opts: TransformOptions
    ) -> dict[str, Any]:
        """A Responses object with the split reasoning as vLLM's ``reasoning`` items, and
        ``usage.output_tokens_details.reasoning_tokens`` counted by the worker's tokenizer."""
        out = transform_responses_body(obj, opts)
        if out is obj:
            return out
        return await self._response_reasoning(ex, out, [t for t in responses_reasoning(out) if t])

    async def _response_reasoning(
        self, ex: Exchange, out: dict[str, Any], texts: list[str]
    ) -> dict[str, Any]:
        """A Responses object with ``usage.output_tokens_details.reasoning_tokens`` counted
        from ``texts`` by the worker's tokenizer (as it was when the worker cannot count)."""
        usage = out.get("usage")
        worker = self.registry.get(ex.worker)
        if not isinstance(usage, dict) or worker is None or worker.url is None:
            return out
        counts = [await self._tokens(worker.url, out.get("model"), t) for t in texts]
        if None not in counts:
            details = usage.get("output_tokens_details")
            new = {**(details if isinstance(details, dict) else {})}
            output = usage.get("output_tokens")
            counted = sum(c or 0 for c in counts)
            if isinstance(output, int):  # all of it when nothing else came out, as vLLM counts
                counted = output if only_reasoning(out) else min(counted, output)
            new["reasoning_tokens"] = counted
            out = {**out, "usage": {**usage, "output_tokens_details": new}}
        return out

    async def _add_reasoning_tokens(
        self, obj: dict[str, Any], texts: list[str], ex: Exchange, only_reasoning: bool
    ) -> None:
        """Set ``usage.completion_tokens_details.reasoning_tokens`` of a body or final stream
        chunk from the worker's ``/tokenize`` of ``texts``; left alone when the worker counted
        token ids itself, when there is no reasoning, or when the worker cannot count."""
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return
        details = usage.get("completion_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
            return  # the worker counted token ids; keep its number
        worker = self.registry.get(ex.worker)
        if worker is None or worker.url is None:
            return
        counts = [await self._tokens(worker.url, obj.get("model"), t) for t in texts if t]
        if None in counts:
            return
        new = {**(details if isinstance(details, dict) else {})}
        counted = sum(c or 0 for c in counts)
        new["reasoning_tokens"] = reasoning_token_count(usage, counted, only_reasoning)
        obj["usage"] = {**usage, "completion_tokens_details": new}

    async def _tokens(self, url: str, model: object, text: str) -> int | None:
        req = {"model": model, "prompt": text, "add_special_tokens": False}
        return await tokenize_count(self.client, url, req)

    # ---- streams ---------------------------------------------------------------------------

    async def stream(self, ex: Exchange) -> Reply:
        data = await self.open(ex)
        resp = ex.resp
        assert resp is not None
        if data is None and may_refuse_budget(ex):
            data = await self._budget_refused(ex)
            if data is not None:
                ex.status = "400"
                return Reply(400, [("content-type", "application/json")], data, after=ex.aclose)
            resp = ex.resp  # the same answer, its first event put back
            assert resp is not None
        if data is not None:
            ex.status = str(resp.status)
            return Reply(resp.status, self._headers(resp, ex), data, after=ex.aclose)
        return Reply(resp.status, self._headers(resp, ex), stream=self.events(ex), after=ex.aclose)

    async def _budget_refused(self, ex: Exchange) -> bytes | None:
        """``peek.budget_refused``; a worker past a bound fails the request (502)."""
        try:
            return await budget_refused(ex, self.client, self.registry, self.max_event_bytes)
        except UpstreamFailure as e:
            ex.status = "upstream_error"
            self._broke(ex, e)
            raise failure_error(e, "before answering") from None

    async def events(self, ex: Exchange) -> AsyncIterator[bytes]:
        """The worker's stream as the client sees it; records status and usage on ``ex``."""
        resp, plan = ex.resp, ex.plan
        assert resp is not None
        model = plan.model.name
        ttft, itl = (
            self.metrics.ttft.labels(model, ex.worker),
            self.metrics.itl.labels(model, ex.worker),
        )
        if plan.kind.shape in _EVENT_SHAPES and plan.transform is not None:
            async for chunk in self._responses_events(ex, plan.transform):
                yield chunk
            return
        reshape = plan.transform is not None or plan.strip_usage
        transformer = ChatStreamTransformer(plan.transform) if plan.transform else None
        strip = (
            UsageStrip(self.max_event_bytes, interleaved=plan.sequences > 1)
            if plan.strip_usage
            else None
        )
        buf = EventBuffer()
        line = bytearray()  # the unended line, for its usage
        last, tail = 0.0, b""
        try:
            async for chunk in self._source(ex):
                now = time.monotonic()
                if last:
                    itl.observe(now - last)
                else:
                    ttft.observe(now - plan.started)
                    ex.prefilled()  # once a stream: its prefill is over
                    _check_first_event(chunk, model)
                last = now
                self._stream_usage(ex, line, chunk)
                if reshape:
                    chunk = await self._reframe(ex, transformer, strip, buf, chunk)
                tail = (tail + chunk)[-16:]
                if chunk:
                    yield chunk
            end = self._ended(ex, strip, tail)
        except UpstreamFailure as e:
            end = self._failed_end(ex, e, strip, tail)
        if end:
            yield end

    @staticmethod
    def _ended(ex: Exchange, strip: UsageStrip | None, tail: bytes) -> bytes:
        """The end of a stream its worker ended: the usage chunk held back (the stream ended
        without it), and the error event where a chat or completions stream lacks its
        ``[DONE]`` (only OpenAI's chunk streams end with it)."""
        held = strip.end() if strip is not None else b""
        if tail.endswith(_DONE) or not ex.plan.kind.usage_option:
            ex.status = "200"
            return held
        ex.status = "truncated"
        return held + stream_error(ex, UpstreamError("The worker ended the stream early."))

    def _failed_end(
        self, ex: Exchange, e: UpstreamFailure, strip: UsageStrip | None, tail: bytes
    ) -> bytes:
        """The end of a stream whose worker failed after its head: nothing when its
        ``[DONE]`` went out (the answer was whole, only the body's end broke), else the usage
        chunk held back and the stream's error event."""
        self._broke(ex, e)
        if tail.endswith(_DONE):
            ex.status = "200"
            return b""
        ex.status = "upstream_error"
        held = strip.end() if strip is not None else b""
        return held + stream_error(ex, failure_error(e, "mid-stream"))

    def _source(self, ex: Exchange) -> AsyncIterator[bytes]:
        """The stream's events as the client gets them, moves included: a Messages or
        Responses stream that may move goes through ``continue_events.py``, every other
        through ``_raw``."""
        m, moving = self.migrator, self.moving.get(ex.plan.kind.shape)
        if m is not None and m.limit and moving is not None:
            return moving.stream(ex)
        return self._raw(ex)

    def _raw(self, ex: Exchange) -> AsyncIterator[bytes]:
        """The worker's chat or completions stream as it sent it; when that worker dies and the
        request may move (``migrate.py``), the next worker's continuation, rewritten to go on as
        the same stream (``transform/continuation.py``, the loop ``continue_events.py``)."""
        resp = ex.resp
        assert resp is not None
        m = self.migrator
        if m is None or not m.limit or not ex.plan.kind.usage_option:
            return resp.iter_raw()
        progress = Progress(ex.plan.kind.shape is Shape.chat)
        if ex.plan.token_ids:  # the gateway asked for them: kept, taken out of what goes out
            progress.token_ids = TokenIds(ex.plan.token_ids)

        async def go_on(ex: Exchange, e: UpstreamFailure) -> Resume | bytes | None:
            return await self._continue(ex, e, progress)

        return migrating(ex, progress, go_on, self.max_event_bytes)

    async def _continue(
        self, ex: Exchange, e: UpstreamFailure, progress: Progress
    ) -> Resume | bytes | None:
        """After ``e``, the stream's continuation open on another worker (its rewriter), its
        end when nothing was left to generate, or None: it fails as before."""
        m = self.migrator
        assert m is not None
        cause = m.cause(ex, e)
        if cause is None:
            m.gave_up(ex, e)
            return None
        plan = ex.plan
        chat = plan.kind.shape is Shape.chat
        if progress.origin is None:
            progress.origin = orjson.loads(plan.body)
            if plan.token_ids:  # the gateway's, not the client's
                progress.origin.pop(FLAG, None)
        origin = progress.origin
        split = plan.transform is not None and plan.transform.parser is not None
        # a gateway-side reasoning split: the raw text holds its <think>, which a chat message
        # cannot hand back; it goes on as a completion of the rendered prompt where it can
        as_text = split and chat and text_only(origin)
        why = None
        if progress.begun:
            lost = "reasoning" if split and not as_text else None
            why = refusal(origin, chat) or progress.broken or lost
        if why is not None:
            m.record(ex, cause, "refused")
            log.warning("request %s: worker %s failed mid-answer (%s); not continued: %s",
                        plan.ctx.request_id, ex.worker, cause, why)  # fmt: skip
            return None
        body = None if progress.finished else continuation(origin, chat, progress)
        if body is None:
            m.record(ex, cause, "ended")
            return end_events(progress, chat)
        if cause == "worker_died" or e.limit is not None:
            self.dispatcher.broke(ex, e)
        sent = progress.sent
        what = f"continued after {sent} tokens" if progress.parts else "sent again"
        if not await m.move(ex, cause, what):
            return None
        resume = await self._open_continuation(ex, body, origin, progress, as_text)
        if isinstance(resume, bytes):
            m.record(ex, cause, "failed")
            log.warning("request %s: continuation on worker %s refused: %s",
                        plan.ctx.request_id, ex.worker, resume[:200])  # fmt: skip
            return None
        m.record(ex, cause, "continued" if progress.parts else "restarted", sent)
        return resume

    async def _open_continuation(
        self,
        ex: Exchange,
        body: dict[str, Any],
        origin: dict[str, Any],
        progress: Progress,
        as_text: bool = False,
    ) -> Resume | bytes:
        """``body`` sent to the exchange's new worker: the rewriter of its stream, or the
        worker's refusal. A chat answer whose text the template rewrites, or ``as_text``
        (its raw text holds a reasoning block), goes on as a completion of vLLM's own
        rendering (``continue_completion.py``)."""
        ids = progress.token_ids
        if ids is not None and ids.usable and ids.generated:
            resume = await self.by_ids.open(ex, origin, progress)
            if not isinstance(resume, bytes):
                return resume
            log.warning("request %s: worker %s did not continue from the token ids (%s); "
                        "going on from the text", ex.plan.ctx.request_id, ex.worker,
                        resume[:200])  # fmt: skip
            progress.token_ids = None
            again = continuation(origin, progress.chat, progress)
            if again is None:
                return b"no token left to generate"
            body = again
        elif ids is not None and progress.parts:
            log.warning("request %s: its worker returned no token ids (an older vLLM?); going "
                        "on from the text", ex.plan.ctx.request_id)  # fmt: skip
        rewritten = progress.chat and bool(progress.parts)
        if rewritten and (as_text or cut(progress.text)):
            return await self.completer.open(ex, origin, progress)
        ex.plan.body = orjson.dumps(body)
        try:
            data = await self.dispatcher.send(ex)
        except GatewayError as err:
            data = err.message.encode()
        if data is not None and rewritten and refused(data):
            return await self.completer.open(ex, origin, progress)
        if data is not None:
            return data
        prompt = await self._prompt_once(ex, origin, progress.chat) if progress.parts else None
        return Resume(progress, prompt)

    async def _prompt_once(self, ex: Exchange, origin: dict[str, Any], chat: bool) -> int | None:
        """The original prompt's tokens by the new worker's ``/tokenize`` (its usage counts
        the text fed back as prompt too; the client's counts it once, as completion)."""
        worker = self.registry.get(ex.worker)
        if worker is None or worker.url is None:
            return None
        return await exact_count(self.client, worker.url, origin, ex.plan.model.name, chat)

    async def _reframe(
        self,
        ex: Exchange,
        t: ChatStreamTransformer | None,
        strip: UsageStrip | None,
        buf: EventBuffer,
        chunk: bytes,
    ) -> bytes:
        """Re-frame the events of ``chunk`` (``buf`` holds a partial event between calls);
        ``strip`` takes out the usage chunk the client did not ask for. Without a transform
        the worker's payloads pass as they came."""
        if t is None and strip is not None and not len(buf) and strip.passes(chunk):
            return chunk  # the common read: one token's event, nothing to take out
        out = bytearray()
        send = strip.event if strip is not None else plain
        for payload in buf.events(chunk):
            if payload == b"[DONE]" and t is not None:
                out += b"".join(send(orjson.dumps(o)) for o in t.finish())
            if t is None or payload.startswith(b":") or payload == b"[DONE]":
                out += send(payload)
                continue
            for o in await self._transformed(ex, t, payload):
                out += send(o)
        if len(buf) > self.max_event_bytes:
            raise self._over_event()
        return bytes(out)

    async def _transformed(
        self, ex: Exchange, t: ChatStreamTransformer, payload: bytes
    ) -> list[bytes]:
        """The payloads a chunk becomes through ``t``; one it cannot read passes as it came."""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return [payload]
        if not isinstance(obj, dict):
            return []
        out = []
        for o in t.feed(obj):
            if t.counts_later and "usage" in o and not o.get("choices"):
                texts = t.reasoning_texts()
                await self._add_reasoning_tokens(o, texts, ex, t.all_reasoning)
            out.append(orjson.dumps(o))
        return out

    def _broke(self, ex: Exchange, e: UpstreamFailure) -> None:
        """After the head, only a crossed bound counts as the worker's failure: a client that
        leaves closes the response too."""
        if e.limit is not None:
            self.dispatcher.broke(ex, e)

    def _over_event(self) -> UpstreamFailure:
        cap = self.max_event_bytes
        return over("upstream_max_event_bytes", f"worker sent an SSE event over {cap} bytes")

    async def _responses_events(self, ex: Exchange, opts: TransformOptions) -> AsyncIterator[bytes]:
        """A Responses or Messages event stream (``event:``/``data:`` blocks) the gateway
        splits."""
        resp = ex.resp
        assert resp is not None
        t: EventTransformer = (
            ResponsesStreamTransformer(opts)
            if ex.plan.kind.shape is Shape.responses
            else MessagesStreamTransformer(opts)
        )
        buf = EventBuffer(crlf=False)  # blocks an unreadable one passes as it came
        line = bytearray()
        out = bytearray()  # this read's events: those before a failure still go out
        try:
            async for chunk in resp.iter_raw():
                if ex.turn is not None:
                    ex.prefilled()  # the first chunk: its prefill is over
                self._stream_usage(ex, line, chunk)
                for block in buf.blocks(chunk):
                    out += await self._event_block(ex, t, block)
                if len(buf) > self.max_event_bytes:
                    raise self._over_event()
                if out:
                    sent = bytes(out)
                    out.clear()
                    yield sent
            tail = b"".join(_event(e, o) for e, o in t.finish())
            if tail:
                yield tail
            ex.status = "200"
        except UpstreamFailure as e:
            ex.status = "upstream_error"
            self._broke(ex, e)
            if self.migrator is not None:  # the split reasoning cannot be handed back
                self.migrator.refuse(ex, e, "reasoning")
            yield bytes(out) + stream_error(ex, failure_error(e, "mid-stream"))

    async def _event_block(self, ex: Exchange, t: EventTransformer, block: bytes) -> bytes:
        """One SSE block through ``t`` (blocks it cannot read pass as is). A Responses stream's
        final ``response`` counts the reasoning the gateway split, as the whole reply does."""
        read = _read_block(block)
        if read is None:
            return block + b"\n\n"
        out = bytearray()
        for event_type, obj in t.feed(*read):
            if event_type in _FINAL and isinstance(t, ResponsesStreamTransformer) and t.reasoning:
                response = obj.get("response")
                if not isinstance(response, dict):  # a broken or hostile worker's
                    raise _no_response(ex, event_type)
                texts = ["".join(t.reasoning)]
                obj = {**obj, "response": await self._response_reasoning(ex, response, texts)}
            out += _event(event_type, obj)
        return bytes(out)

    def _stream_usage(self, ex: Exchange, partial: bytearray, chunk: bytes) -> None:
        """Read the usage of every ``data:`` line that ends in ``chunk``. ``partial`` holds the
        unended line of the chunks before and is left holding the one ``chunk`` leaves unended,
        kept only while it is within ``max_event_bytes`` (appended to in place: a long line in
        many chunks is copied once, not once per chunk)."""
        end = chunk.rfind(b"\n")
        if end < 0:
            partial += chunk
            if len(partial) > self.max_event_bytes:
                partial.clear()
            return
        text = bytes(partial) + chunk[:end] if partial else chunk  # (an unended one fails)
        partial[:] = chunk[end + 1 :] if len(chunk) - end - 1 <= self.max_event_bytes else b""
        if b'"usage"' in text:
            for line in text.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                        ex.note_usage(_usage_of(orjson.loads(line[5:])))


def stream_error(ex: Exchange, e: GatewayError) -> bytes:
    """An error inside a stream that has begun, in the stream's own protocol: vLLM's error
    chunk and ``[DONE]`` for chat/completions, an ``error`` event for Responses and Messages."""
    if ex.plan.kind.usage_option:
        return e.sse_event()
    event: dict[str, object]
    if ex.plan.kind.shape is Shape.responses:
        event = {"type": "error", "code": str(e.status), "message": e.message, "param": None}
    else:
        event = {"type": "error", "error": {"type": "api_error", "message": e.message}}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


def _no_response(ex: Exchange, event_type: str) -> UpstreamFailure:
    """A Responses stream's final event without the ``response`` whose reasoning the gateway
    must count: logged with the worker's name; the client gets the stream's error event."""
    what = f"worker sent {event_type} without its response object"
    log.warning("worker %s: %s (request %s)", ex.worker, what, ex.plan.ctx.request_id)
    return UpstreamFailure(what, sent=True)


def _event(event_type: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def _read_block(block: bytes) -> tuple[str, dict[str, Any]] | None:
    """(event type, object) of one ``event:``/``data:`` SSE block; None when it is not one."""
    event_type, data = None, None
    for line in block.split(b"\n"):
        if line.startswith(b"event:"):
            event_type = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
    if event_type is None or data is None:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return (event_type, obj) if isinstance(obj, dict) else None


def _same_model(data: bytes, name: str) -> bool:
    """Whether a whole answer names no model, or ``name`` (the one the gateway sent): read
    without parsing when written as vLLM writes it, else by orjson."""
    if b'"model":"' + name.encode() + b'"' in data or b'"model"' not in data:
        return True
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return True  # not JSON: nothing names a model
    got = obj.get("model") if isinstance(obj, dict) else None
    return not isinstance(got, str) or got == name


def _check_first_event(chunk: bytes, name: str) -> None:
    """A stream's first chunk: its first event, when whole, names no model or ``name``."""
    start = chunk.find(b"data:")
    end = chunk.find(b"\n", start)
    if start >= 0 and end > start and not _same_model(chunk[start + 5 : end], name):
        raise over("model", "worker answered for another model")


def _usage_of(obj: dict[str, Any]) -> object:
    """``usage`` of a chunk (chat, completions, Messages' delta), or of the object a
    Responses or Messages event carries."""
    usage = obj.get("usage")
    if usage is None:
        inner = obj.get("response") or obj.get("message")
        usage = inner.get("usage") if isinstance(inner, dict) else None
    return usage
