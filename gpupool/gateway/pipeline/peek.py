"""A stream's first event read before the client's head is sent, then given back in order.

vLLM's Anthropic adapter refuses ``thinking.budget_tokens`` on a worker without a reasoning
config only inside the stream: HTTP 200, then an ``error`` event in pydantic's words (its
adapter cannot read the chat's error chunk), where the whole reply is a clear 400. To answer
both the same way, the relay reads such a stream's first event first
(:func:`budget_refused`); when it is not an error, :class:`Replayed` serves the stream from its
first byte as if nothing had been read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.pipeline.kinds import Shape
from gpupool.gateway.transform.messages import budget_refusal
from gpupool.gateway.upstream.client import DataPath, Response, UpstreamFailure
from gpupool.gateway.upstream.limits import over
from gpupool.workers.registry import Registry


class Replayed:
    """``resp`` with ``head`` (bytes already read from ``rest``) put back in front."""

    def __init__(self, resp: Response, head: bytes, rest: AsyncIterator[bytes]) -> None:
        self.resp = resp
        self.status = resp.status
        self.headers = resp.headers
        self.content_type = resp.content_type
        self._head = head
        self._rest = rest

    async def read(self) -> bytes:
        return self._head + b"".join([chunk async for chunk in self._rest])

    def read_now(self) -> bytes | None:
        return None

    async def iter_raw(self) -> AsyncIterator[bytes]:
        if self._head:
            head, self._head = self._head, b""
            yield head
        async for chunk in self._rest:
            yield chunk

    def close(self) -> None:
        self.resp.close()


async def peek_first_event(resp: Response, limit: int) -> tuple[bytes, Replayed]:
    """The bytes up to the end of the stream's first event (all of it if it ends first), and
    the response to relay from its start. Raises ``UpstreamFailure`` past ``limit`` bytes."""
    rest = resp.iter_raw().__aiter__()
    head = b""
    async for chunk in rest:
        head += chunk
        if b"\n\n" in head or b"\r\n\r\n" in head:
            break
        if len(head) > limit:
            raise over("upstream_max_event_bytes", f"worker sent an SSE event over {limit} bytes")
    return head, Replayed(resp, head, rest)


def may_refuse_budget(ex: Exchange) -> bool:
    """A Messages stream the gateway splits, asking for a thinking budget, answered 200."""
    plan, resp = ex.plan, ex.resp
    return (
        plan.kind.shape is Shape.messages
        and plan.transform is not None
        and resp is not None
        and resp.status == 200
        and b"budget_tokens" in plan.body
    )


async def budget_refused(
    ex: Exchange, client: DataPath, registry: Registry, limit: int
) -> bytes | None:
    """A Messages stream with ``thinking.budget_tokens`` that the gateway splits: vLLM
    refuses the budget (no reasoning config) only inside the stream, after its 200, with
    an ``error`` event whose words are pydantic's, not the refusal's. So its first event
    is read before the client's head; when it is an error, the worker is asked the same
    request whole, and its 400 (the refusal, in the gateway's words: ``budget_refusal``)
    is the answer, as when not streamed. Otherwise the stream goes out from its start."""
    resp = ex.resp
    assert resp is not None
    head, ex.resp = await peek_first_event(resp, limit)  # UpstreamFailure past the limit
    if not head.startswith(b"event: error"):
        return None
    worker = registry.get(ex.worker)
    if worker is None or worker.url is None:
        return None
    body = orjson.loads(ex.plan.body)
    body["stream"] = False
    try:
        whole = await client.open(
            "POST", worker.url + ex.plan.kind.path, orjson.dumps(body),
            {"content-type": "application/json"},
        )  # fmt: skip
        data = await whole.read()
    except UpstreamFailure:
        return None
    if whole.status != 400:
        return None
    return budget_refusal(ex.plan.model.name, data) or data
