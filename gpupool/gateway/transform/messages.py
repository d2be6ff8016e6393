"""``/v1/messages`` (vLLM's Anthropic adapter) when the gateway splits reasoning, on parsed JSON.

A worker without ``--reasoning-parser`` answers with its ``<think>…</think>`` in a ``text``
block. vLLM with a parser answers with a ``thinking`` block first (its ``signature`` a fresh
``uuid4().hex``), then the text, then any ``tool_use`` (``entrypoints/anthropic/serving.py``);
these functions make the first look like the second:

* :func:`thinking_switch` — the request's ``thinking: {type: enabled|disabled}`` as the chat
  template's ``enable_thinking``, for parsers that read it (so the gateway knows where the
  answer starts).
* :func:`transform_messages_body` — a whole ``message`` object.
* :class:`MessagesStreamTransformer` — ``event: <type>`` / ``data: <json>`` events one at a
  time, in vLLM's order::

      content_block_start(text)             held until text comes
      content_block_delta text "<think>ab"  → content_block_start(thinking) thinking_delta "ab"
      content_block_delta text "</think>Hi" → signature_delta content_block_stop
                                              content_block_start(text) text_delta "Hi"
      content_block_stop                    → content_block_stop (of whichever block is open)

  Blocks are numbered again as they are started (a thinking block takes an index), so a
  ``tool_use`` block after the text moves down by one.
* :func:`budget_refusal` — vLLM's 400 for ``thinking.budget_tokens`` on a worker that has no
  reasoning config, said in the gateway's words: nothing can end the thinking at a budget.

Objects are never mutated; unchanged ones are returned as the same object.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gpupool.gateway.transform.chat import TransformOptions
from gpupool.gateway.transform.reasoning import ReasoningParser, get_parser

Json = dict[str, Any]
Event = tuple[str, Json]

_NO_BUDGET = b"thinking_token_budget is set but reasoning_config is not configured"


def _signature() -> str:
    return uuid.uuid4().hex  # what vLLM's adapter signs a thinking block with


# ---- request ------------------------------------------------------------------------------


def thinking_switch(body: Json, parser: str) -> bool:
    """Set ``chat_template_kwargs.enable_thinking`` from ``thinking.type`` (``enabled``: on,
    ``disabled``: off) when ``parser`` starts from that switch; a client's own
    ``enable_thinking`` wins. Edits ``body`` in place; returns whether it changed."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or not get_parser(parser).uses_enable_thinking:
        return False
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        return False  # "adaptive": the model chooses; nothing to pin
    kwargs = body.get("chat_template_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    if kwargs.get("enable_thinking") is not None:
        return False
    body["chat_template_kwargs"] = {**kwargs, "enable_thinking": kind == "enabled"}
    return True


def budget_refusal(model: str, data: bytes) -> bytes | None:
    """The gateway's 400 (Anthropic's error shape) for a worker's refusal of
    ``thinking.budget_tokens``, or None when ``data`` is another answer."""
    if _NO_BUDGET not in data:
        return None
    message = (
        f"thinking.budget_tokens cannot be honoured for model `{model}`: its worker runs "
        "without vLLM's reasoning parser or reasoning config (the gateway splits its "
        "reasoning), so nothing can end the thinking at a budget. Send "
        '`thinking: {"type": "adaptive"}` to think without a budget, or '
        '`{"type": "disabled"}`; or start the worker with --reasoning-parser or '
        "--reasoning-config."
    )
    error = {"type": "BadRequestError", "message": message}
    return orjson.dumps({"type": "error", "error": error})


# ---- non-streaming ------------------------------------------------------------------------


def transform_messages_body(obj: Json, opts: TransformOptions) -> Json:
    """A ``message`` whose first ``text`` block is split into a ``thinking`` block and the
    text after it (an all-reasoning answer keeps no text block; nothing at all: one empty
    text block, as vLLM answers an empty completion)."""
    content = obj.get("content")
    parser = opts.new_parser()
    if parser is None or not isinstance(content, list):
        return obj
    if any(isinstance(b, dict) and b.get("type") == "thinking" for b in content):
        return obj  # the worker split already
    out: list[Any] = []
    split = False
    for block in content:
        text = block.get("text") if isinstance(block, dict) else None
        if split or not isinstance(text, str) or block.get("type") != "text":
            out.append(block)
            continue
        split = True
        reasoning, answer = parser.split(text)
        if reasoning is None and answer == text:
            return obj  # thinking was off: nothing to move
        if reasoning:
            out.append({"type": "thinking", "thinking": reasoning, "signature": _signature()})
        if answer:
            out.append({**block, "text": answer})
    if not split:
        return obj
    return {**obj, "content": out or [{"type": "text", "text": ""}]}


# ---- streaming ----------------------------------------------------------------------------


class MessagesStreamTransformer:
    """Reshape one ``/v1/messages`` event stream. ``feed(event_type, obj)`` returns the events
    to send in its place (often none or several); ``finish()`` what was still held back."""

    def __init__(self, opts: TransformOptions) -> None:
        self._opts = opts
        self._parser: ReasoningParser | None = None  # while the worker's text block is open
        self._text_index: int | None = None  # the worker's index of that block
        self._done = False  # the worker's text block was split (only the first is)
        self._open: str | None = None  # the type of the block we have open
        self._signature = ""
        self._next = 0  # the index our next block takes
        self._index: dict[int, int] = {}  # the worker's block index -> ours (other blocks)
        self._worker_splits = False

    def feed(self, event_type: str, obj: Json) -> list[Event]:
        if self._worker_splits or self._opts.parser is None:
            return [(event_type, obj)]
        index = obj.get("index")
        if event_type == "content_block_start":
            return self._start(obj, index)
        if index is not None and index == self._text_index:
            if event_type == "content_block_delta":
                delta = obj.get("delta")
                text = delta.get("text") if isinstance(delta, dict) else None
                return self._text(*self._feed(text)) if isinstance(text, str) else []
            if event_type == "content_block_stop":
                return self._end_text()
        if event_type in ("message_delta", "message_stop") and self._parser is not None:
            return [*self._end_text(), (event_type, obj)]
        if isinstance(index, int) and index in self._index:
            return [(event_type, {**obj, "index": self._index[index]})]
        return [(event_type, obj)]

    def finish(self) -> list[Event]:
        """End of stream inside the text block: what was held, and the block closed."""
        return self._end_text() if self._parser is not None else []

    # -- the worker's blocks -------------------------------------------------------------------

    def _start(self, obj: Json, index: Any) -> list[Event]:
        block = obj.get("content_block")
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "thinking":
            self._worker_splits = True  # a worker with vLLM's parser: nothing to do
            return [("content_block_start", obj)]
        if kind == "text" and not self._done and isinstance(index, int):
            self._parser, self._text_index = self._opts.new_parser(), index
            return []  # held until its first text says whether it is thinking or text
        out = self._close()
        if isinstance(index, int):
            self._index[index] = self._next
        self._next += 1
        return [*out, ("content_block_start", {**obj, "index": self._next - 1})]

    def _feed(self, text: str) -> tuple[str, str]:
        assert self._parser is not None
        return self._parser.feed(text)

    def _end_text(self) -> list[Event]:
        parser, self._parser, self._text_index, self._done = self._parser, None, None, True
        tail = self._text(*parser.finish()) if parser is not None else []
        return [*tail, *self._close()]

    # -- ours ----------------------------------------------------------------------------------

    def _text(self, reasoning: str, content: str) -> list[Event]:
        out: list[Event] = []
        if reasoning:
            out += self._open_block("thinking")
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            out += self._open_block("text")
            out.append(self._delta({"type": "text_delta", "text": content}))
        return out

    def _open_block(self, kind: str) -> list[Event]:
        if self._open == kind:
            return []
        out = self._close()
        self._open = kind
        self._signature = _signature() if kind == "thinking" else ""
        block: Json = {"type": kind, kind: ""}
        start = {"type": "content_block_start", "content_block": block, "index": self._next}
        return [*out, ("content_block_start", start)]

    def _delta(self, delta: Json) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "delta": delta,
                                       "index": self._next}  # fmt: skip

    def _close(self) -> list[Event]:
        """Close the block we have open: a thinking block's signature goes first."""
        if self._open is None:
            return []
        out: list[Event] = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": self._signature}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self._next}))
        self._open = None
        self._next += 1
        return out
