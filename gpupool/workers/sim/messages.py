"""vLLM's Anthropic ``/v1/messages`` and ``/v1/messages/count_tokens`` over the simulator's chat.

vLLM 0.32 serves them with an adapter (``entrypoints/anthropic/serving.py``) that turns the
request into a chat completion, runs it, and turns the answer back; the simulator does the same,
in the same words and shapes (text and, with ``--reasoning-parser``, thinking blocks; no tools):

* the request: ``system`` first, each message's text blocks joined, ``max_tokens``,
  ``stop_sequences`` as ``stop``; ``thinking: {type: disabled}`` as ``reasoning_effort: none``;
  ``{type: enabled, budget_tokens}`` as vLLM's ``thinking_token_budget``, which a worker without
  a reasoning config refuses (:data:`NO_BUDGET`): a 400 when not streamed, and when streamed a
  200 whose only events are vLLM's ``error`` (its adapter fails to read the chat's error chunk)
  and nothing else, as vLLM does;
* a whole answer: ``{id, type, role, content, model, stop_reason, [stop_sequence], usage}``
  (``model_dump(exclude_none=True)``), a ``thinking`` block (with a fresh ``signature``) before
  the text, one empty text block when nothing came out;
* a stream: ``message_start`` (the prompt's tokens), ``content_block_start`` / ``_delta`` /
  ``_stop`` per block (a thinking block ends with its ``signature_delta``), ``message_delta``
  with the stop reason and usage, ``message_stop``; each ``event: <type>\\ndata: <json>``;
* errors as ``{"type": "error", "error": {type, message}}`` with the chat's status.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel

from gpupool.workers.sim.errors import SimError
from gpupool.workers.sim.jobs import Meta
from gpupool.workers.sim.protocol import parse_body
from gpupool.workers.sim.tokenize import content_text

Json = dict[str, Any]

NO_BUDGET = (
    "thinking_token_budget is set but reasoning_config is not configured. Please set "
    "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
)
# What vLLM's adapter says when a stream's first chunk is the chat's error chunk (pydantic
# reading it as a ChatCompletionStreamResponse): the refusal's own words are cut from it.
STREAM_REFUSAL = (  # vLLM 0.32's words, read from a real worker (pydantic 2.14 there)
    "2 validation errors for ChatCompletionStreamResponse\nmodel\n  Field required "
    "[type=missing, input_value={'error': {'message': 'th...am': None, 'code': 400}}, "
    "input_type=dict]\n    For further information visit "
    "https://errors.pydantic.dev/2.14/v/missing\nchoices\n  Field required [type=missing, "
    "input_value={'error': {'message': 'th...am': None, 'code': 400}}, input_type=dict]\n    "
    "For further information visit https://errors.pydantic.dev/2.14/v/missing"
)


class MessagesRequest(BaseModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


Chat = Callable[[bytes, Meta], Awaitable[Any]]


class BudgetRefused(SimError):
    """vLLM's refusal of ``thinking_token_budget`` without a reasoning config."""

    status = 400
    type = "BadRequestError"


def chat_messages(req: MessagesRequest | CountTokensRequest) -> list[Json]:
    """The chat messages vLLM's adapter makes: the system prompt first, text joined."""
    out: list[Json] = []
    if req.system:
        out.append({"role": "system", "content": content_text(req.system)})
    for msg in req.messages:
        out.append({"role": msg.get("role", "user"), "content": content_text(msg.get("content"))})
    return out


def chat_request(req: MessagesRequest, parser: bool) -> Json:
    """The chat body for ``req``; :class:`BudgetRefused` for a budget without a parser."""
    body: Json = {"model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens}
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.chat_template_kwargs:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    kind = (req.thinking or {}).get("type")
    if kind == "disabled":
        body["reasoning_effort"] = "none"
    elif kind == "enabled" and not parser:
        raise BudgetRefused(NO_BUDGET)
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def error_body(status: int, body: bytes) -> bytes:
    """A chat error (``{"error": {message, type, …}}``) in the adapter's shape."""
    try:
        err = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        err = {}
    error = {"type": err.get("type", "InternalServerError"), "message": err.get("message", "")}
    return orjson.dumps({"type": "error", "error": error})


def stop_reason(finish: str | None) -> str | None:
    if finish == "length":
        return "max_tokens"
    return "end_turn" if finish in ("stop", "tool_calls", "abort") else None


def anthropic_usage(usage: Json | None) -> Json:
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens") or 0}  # fmt: skip


def message_body(chat: Json) -> bytes:
    """A whole chat answer as vLLM's adapter writes it (``model_dump(exclude_none=True)``)."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    content: list[Json] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"],
                        "signature": uuid.uuid4().hex})  # fmt: skip
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    if not content:
        content.append({"type": "text", "text": ""})
    out: Json = {"id": chat["id"], "type": "message", "role": "assistant", "content": content,
                 "model": chat["model"]}  # fmt: skip
    reason = stop_reason(choice.get("finish_reason"))
    if reason is not None:
        out["stop_reason"] = reason
    out["usage"] = anthropic_usage(chat.get("usage"))
    return orjson.dumps(out)


def _event(kind: str, obj: Json) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def _delta_event(delta: Json, index: int) -> bytes:
    return _event("content_block_delta", {"type": "content_block_delta", "delta": delta,
                                          "index": index})  # fmt: skip


class _Converter:
    """The adapter's state over one chat stream: the open content block (numbered as the
    adapter numbers them), whether ``message_start`` went, the finish reason."""

    def __init__(self) -> None:
        self.index = 0
        self.kind: str | None = None
        self.first = True
        self.finish: str | None = None
        self.ended = False

    def feed(self, payload: bytes) -> list[bytes]:
        """The events for one chat ``data:`` payload."""
        if payload == b"[DONE]":
            return [*self.stop(), _event("message_stop", {"type": "message_stop"})]
        chunk = orjson.loads(payload)
        if "error" in chunk:  # the adapter cannot read it: its error event ends the stream
            self.ended = True
            err = {"type": "internal_error", "message": STREAM_REFUSAL}
            return [_event("error", {"type": "error", "error": err})]
        if self.first:
            self.first = False
            return [_event("message_start", {"type": "message_start", "message": _start(chunk)})]
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk
            delta = {"stop_reason": stop_reason(self.finish or "stop"), "stop_sequence": None}
            usage = anthropic_usage(chunk.get("usage"))
            end = {"type": "message_delta", "delta": delta, "usage": usage}
            return [*self.stop(), _event("message_delta", end)]
        self.finish = choices[0].get("finish_reason") or self.finish
        d = choices[0].get("delta") or {}
        out: list[bytes] = []
        for kind, key in (("thinking", "reasoning"), ("text", "content")):
            if d.get(key):
                out += self.delta(kind, d[key])
        return out

    def delta(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.kind == kind else [*self.stop(), self._start(kind)]
        field = "thinking" if kind == "thinking" else "text"
        out.append(_delta_event({"type": field + "_delta", field: text}, self.index))
        return out

    def _start(self, kind: str) -> bytes:
        self.kind = kind
        start = {"type": "content_block_start", "content_block": {"type": kind, kind: ""}}
        return _event("content_block_start", {**start, "index": self.index})

    def stop(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            signature = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            out.append(_delta_event(signature, self.index))
        out.append(
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self.kind = None
        self.index += 1
        return out


async def message_events(chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """The chat stream's chunks (continuous usage on) as the adapter's events."""
    conv = _Converter()
    try:
        async for raw in chunks:
            for line in raw.split(b"\n"):
                if line.startswith(b"data: "):
                    for event in conv.feed(line[6:]):
                        yield event
                    if conv.ended:
                        return
    finally:
        await chunks.aclose()


def _start(chunk: Json) -> Json:
    return {"id": chunk["id"], "type": "message", "role": "assistant", "content": [],
            "model": chunk["model"], "stop_reason": None, "stop_sequence": None,
            "usage": anthropic_usage(chunk.get("usage"))}  # fmt: skip


async def refused_stream() -> AsyncGenerator[bytes, None]:
    """A streamed budget refusal as vLLM sends it: the chat's error chunk, read by the adapter."""
    err = orjson.dumps({"error": {"message": NO_BUDGET, "type": "BadRequestError",
                                  "param": None, "code": 400}})  # fmt: skip
    async for e in message_events(_once(b"data: " + err + b"\n\ndata: [DONE]\n\n")):
        yield e


async def _once(data: bytes) -> AsyncGenerator[bytes, None]:
    yield data


def parse_messages(body: bytes, meta: Meta) -> MessagesRequest:
    return parse_body(body, MessagesRequest, meta.media_ok)


def parse_count(body: bytes, meta: Meta) -> CountTokensRequest:
    return parse_body(body, CountTokensRequest, meta.media_ok)
