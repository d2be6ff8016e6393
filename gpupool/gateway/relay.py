"""Relaying a worker's answer to the client: whole bodies and SSE streams.

Streams pass upstream bytes through untouched unless a transform (reasoning split or rename) is
configured; then events are parsed and re-framed. A stream never ends silently: a worker that
dies mid-stream yields vLLM's in-stream error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gpupool.gateway.admission.base import Lease
from gpupool.gateway.errors import GatewayError, UpstreamError
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.reply import Reply
from gpupool.gateway.tokens import tokenize_count
from gpupool.gateway.transform.chat import (
    ChatStreamTransformer,
    TransformOptions,
    all_reasoning,
    chat_reasoning_texts,
    reasoning_token_count,
    transform_chat_response,
)
from gpupool.gateway.transform.sse import frame, iter_events
from gpupool.gateway.upstream.client import UpstreamFailure, UpstreamResponse
from gpupool.workers.supervisor.command import worker_reasoning_parser

if TYPE_CHECKING:
    from gpupool.gateway.proxy import Attempt, Context, Proxy

_DONE = b"data: [DONE]\n\n"
# vLLM's usage object: numbers, nulls and one level of nested *_details objects
_USAGE = re.compile(rb'"usage":(\{(?:[^{}]|\{[^{}]*\})*\})')


@dataclass(slots=True)
class StreamPlan:
    attempt: Attempt
    ctx: Context
    transform: TransformOptions | None
    started: float


class Relay:
    def __init__(self, proxy: Proxy, metrics: Metrics) -> None:
        self.proxy = proxy
        self.metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    def soon(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run cleanup that must finish even when the caller is being cancelled."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _headers(self, resp: UpstreamResponse, lease: Lease) -> list[tuple[str, str]]:
        headers = resp.headers
        if self.proxy.cfg.server.expose_worker_header:
            headers = [*headers, ("x-gpupool-worker", lease.worker)]
        return headers

    def _observe(self, plan: StreamPlan, lease: Lease, status: int | str) -> None:
        model = plan.attempt.model.name
        self.metrics.requests.labels(model, lease.worker, str(status)).inc()
        elapsed = time.monotonic() - plan.started
        self.metrics.latency.labels(model, lease.worker).observe(elapsed)
        if status == 200:
            self.proxy.router.served(plan.attempt.route, lease.worker)
            w = self.proxy.registry.get(lease.worker)
            if w is not None:
                w.consecutive_failures = 0

    def _usage(self, plan: StreamPlan, lease: Lease, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        for kind in ("prompt", "completion"):
            n = usage.get(f"{kind}_tokens")
            if isinstance(n, int) and n > 0:
                self.metrics.tokens.labels(plan.attempt.model.name, lease.worker, kind).inc(n)
                plan.ctx.tokens.append(n)

    # ---- whole bodies ----------------------------------------------------------------------

    async def whole(self, plan: StreamPlan, lease: Lease) -> Reply:
        resp, lease, data = await self.proxy.dispatch(plan.attempt, lease, plan.ctx)
        plan.transform = self._worker_transform(plan, lease)
        try:
            if data is None:
                data = await resp.read()
            if resp.status == 200 and plan.transform is not None:
                data = await self._finish_body(plan, lease, data)
        except UpstreamFailure as e:
            self._observe(plan, lease, "upstream_error")
            await self.proxy.release(lease)
            raise UpstreamError(f"The worker failed before answering: {e}.") from None
        except BaseException:
            await self.proxy.release(lease)
            raise
        untouched = data if resp.status == 200 and plan.transform is None else None
        reply = Reply(resp.status, self._headers(resp, lease), data)
        reply.after = functools.partial(self._account, plan, lease, resp.status, untouched)
        return reply

    def _worker_transform(self, plan: StreamPlan, lease: Lease) -> TransformOptions | None:
        """A worker that runs vLLM's reasoning parser itself is never split again."""
        wc = next((w for w in self.proxy.cfg.workers if w.name == lease.worker), None)
        if plan.transform is None or wc is None:
            return plan.transform
        opts = plan.transform.for_worker(worker_reasoning_parser(wc, plan.attempt.model))
        return opts if opts.needs_transform else None

    async def _account(
        self, plan: StreamPlan, lease: Lease, status: int, untouched: bytes | None
    ) -> None:
        """After the body went out: its usage, the request's metrics, the slot back."""
        try:
            if untouched is not None:
                self._body_usage(plan, lease, untouched)
            self._observe(plan, lease, status)
        finally:
            await self.proxy.release(lease)

    async def _finish_body(self, plan: StreamPlan, lease: Lease, data: bytes) -> bytes:
        """A 200 body the gateway must rewrite (reasoning split or renamed); usage read too."""
        opts = plan.transform
        assert opts is not None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        if not isinstance(obj, dict):
            return data
        self._usage(plan, lease, obj.get("usage"))
        out = transform_chat_response(obj, opts)
        if opts.parser is not None:  # the gateway split, so vLLM could not count
            texts = chat_reasoning_texts(obj, opts)
            await self._add_reasoning_tokens(out, texts, lease, all_reasoning(out))
        return orjson.dumps(out)

    async def _add_reasoning_tokens(
        self, obj: dict[str, Any], texts: list[str], lease: Lease, only_reasoning: bool
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
        worker = self.proxy.registry.get(lease.worker)
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
        return await tokenize_count(self.proxy.client, url, req)

    def _body_usage(self, plan: StreamPlan, lease: Lease, data: bytes) -> None:
        """Read only the ``usage`` object of a body that passes through untouched."""
        start = data.rfind(b'"usage":{')
        found = _USAGE.match(data, start) if start >= 0 else None
        if found is not None:
            with contextlib.suppress(orjson.JSONDecodeError):
                self._usage(plan, lease, orjson.loads(found.group(1)))

    # ---- streams ---------------------------------------------------------------------------

    async def stream(self, plan: StreamPlan, lease: Lease) -> Reply:
        resp, lease, data = await self.proxy.dispatch(plan.attempt, lease, plan.ctx)
        if data is not None:
            self._observe(plan, lease, resp.status)
            await self.proxy.release(lease)
            return Reply(resp.status, self._headers(resp, lease), data)
        return Reply(resp.status, self._headers(resp, lease), stream=self._relay(plan, resp, lease))

    async def queued(
        self, plan: StreamPlan, task: asyncio.Future[Lease], positions: asyncio.Queue[int]
    ) -> AsyncIterator[bytes]:
        """A stream that waits in the queue first, telling the client its position."""
        try:
            yield b": queued\n\n"
            while not task.done():
                getter: asyncio.Future[int] = asyncio.ensure_future(positions.get())
                waiting: set[asyncio.Future[Any]] = {task, getter}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield f": queued position={getter.result()}\n\n".encode()
                else:
                    getter.cancel()
            resp, lease, data = await self.proxy.dispatch(plan.attempt, task.result(), plan.ctx)
        except GatewayError as e:
            yield e.sse_event()
            return
        finally:
            if not task.done():
                task.cancel()  # the client left while queued: never executed
        if data is not None:
            self._observe(plan, lease, resp.status)
            self.soon(self.proxy.release(lease))
            yield b"data: " + data + b"\n\ndata: [DONE]\n\n"
            return
        async for chunk in self._relay(plan, resp, lease):
            yield chunk

    async def _relay(
        self, plan: StreamPlan, resp: UpstreamResponse, lease: Lease
    ) -> AsyncIterator[bytes]:
        model, worker = plan.attempt.model.name, lease.worker
        ttft, itl = self.metrics.ttft.labels(model, worker), self.metrics.itl.labels(model, worker)
        plan.transform = self._worker_transform(plan, lease)
        transformer = ChatStreamTransformer(plan.transform) if plan.transform else None
        buf = bytearray()
        last, tail, status = 0.0, b"", "200"
        try:
            async for chunk in resp.iter_raw():
                now = time.monotonic()
                (itl.observe(now - last) if last else ttft.observe(now - plan.started))
                last = now
                if b'"usage"' in chunk:
                    self._stream_usage(plan, lease, chunk)
                if transformer is not None:
                    chunk = await self._transform(transformer, buf, chunk, lease)
                tail = (tail + chunk)[-16:]
                if chunk:
                    yield chunk
            if not tail.endswith(_DONE):
                status = "truncated"
                yield UpstreamError("The worker ended the stream early.").sse_event()
        except UpstreamFailure as e:
            status = "upstream_error"
            yield UpstreamError(f"The worker failed mid-stream ({e}).").sse_event()
        finally:
            resp.close()
            self._observe(plan, lease, 200 if status == "200" else status)
            self.soon(self.proxy.release(lease))

    async def _transform(
        self, t: ChatStreamTransformer, buf: bytearray, chunk: bytes, lease: Lease
    ) -> bytes:
        """Re-frame the events of ``chunk`` (``buf`` holds a partial event between calls)."""
        out = bytearray()
        for payload in iter_events(buf, chunk):
            if payload.startswith(b":"):
                out += payload + b"\n\n"
            elif payload == b"[DONE]":
                out += b"".join(frame(o) for o in t.finish())
                out += _DONE
            else:
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    out += b"data: " + payload + b"\n\n"
                    continue
                if not isinstance(obj, dict):
                    continue
                for o in t.feed(obj):
                    if t.counts_later and "usage" in o and not o.get("choices"):
                        texts = t.reasoning_texts()
                        await self._add_reasoning_tokens(o, texts, lease, t.all_reasoning)
                    out += frame(o)
        return bytes(out)

    def _stream_usage(self, plan: StreamPlan, lease: Lease, chunk: bytes) -> None:
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                    self._usage(plan, lease, orjson.loads(line[6:]).get("usage"))
