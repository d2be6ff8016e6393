"""Continuing a streamed ``/v1/messages`` answer on another worker (request migration).

vLLM's Anthropic adapter cannot continue a final assistant message (it renders a generation
prompt after it), so a Messages answer goes on as a completion of vLLM's own rendering, as a
chat answer whose template rewrites its text does (``pipeline/continue_completion.py``)::

    the Messages request ── chat_messages (the adapter's conversion: system first, text
                            blocks) ── new worker's /tokenize (generation prompt) ──▶ prompt ids
    the text so far     ── /tokenize (no special tokens) ─────────────────────────▶ its ids
    POST /v1/completions {prompt: both, temperature, top_p, top_k, stop_sequences as stop,
                          max_tokens less the tokens sent} (stream, usage)
    its text_completion chunks ── AsMessages ──▶ the client's Anthropic event stream

* :class:`MessagesProgress` reads the Anthropic events the client is given: the message's id,
  the text so far, the open text block's index, whether the message's end went out, and what
  makes it impossible to continue (a thinking or tool_use block).
* :func:`messages_refusal` says why a request cannot be continued as text: tools offered,
  thinking or output settings, images or other non-text blocks, an inline system message
  (whether the adapter merges it depends on the worker's template).
* :class:`AsMessages` re-frames the completion's chunks: ``text_delta`` events on the open
  block (a new text block when none is open), then ``content_block_stop``, one
  ``message_delta`` (``stop_reason`` from the finish reason as the adapter maps it; usage:
  ``input_tokens`` the rendered prompt's, ``output_tokens`` the tokens the client had plus
  the new worker's) and ``message_stop``.

A token is counted per ``text_delta`` event (the adapter sends one per engine step): an
estimate where a worker merges steps, as for chat (docs/migration.md).
"""

from __future__ import annotations

from typing import Any

import orjson

from gpupool.gateway.transform.reframe import AsEvents, Rewriter, StreamProgress

Json = dict[str, Any]

_BILLING = "x-anthropic-billing-header"  # the adapter drops such system text (prefix caching)
# what makes an answer's rest impossible to rebuild from its text
_BROKEN_BLOCKS = {"thinking": "reasoning", "redacted_thinking": "reasoning",
                  "tool_use": "tool_call"}  # fmt: skip
_BROKEN_DELTAS = {"thinking_delta": "reasoning", "signature_delta": "reasoning",
                  "input_json_delta": "tool_call"}  # fmt: skip


def messages_refusal(body: Json) -> str | None:
    """Why a Messages answer cannot go on as plain text once it has begun; None when it can
    (each reason is in docs/migration.md)."""
    if body.get("tools"):
        return "tools"
    if body.get("thinking") is not None or body.get("output_config") is not None:
        return "thinking"  # a reasoning effort or budget, or a format: other rendering, grammar
    if body.get("kv_transfer_params") or body.get("ec_transfer_params"):
        return "kv_transfer_params"
    if not _text_blocks(body.get("system"), allow_none=True):
        return "media"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages"
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            return "messages"  # an inline system message: merged or not by the template
        if not _text_blocks(m.get("content")):
            return "media"
    return None


def _text_blocks(content: object, allow_none: bool = False) -> bool:
    if content is None:
        return allow_none
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text", ""), str)
        for b in content
    )


def chat_messages(body: Json) -> list[Json]:
    """The chat messages vLLM's adapter makes of a text-only Messages request
    (``to_chat_completion_request``): the system text first, joined; each message's non-empty
    text blocks, one as a string, several as text parts; a user message with none dropped."""
    out: list[Json] = []
    system = body.get("system")
    parts = [system] if isinstance(system, str) else _texts(system)
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for m in body["messages"]:
        msg: Json = {"role": m["role"]}
        content = m.get("content")
        if isinstance(content, str):
            msg["content"] = content
        else:
            texts = [b["text"] for b in content if b.get("text")]
            if len(texts) == 1:
                msg["content"] = texts[0]
            elif texts:
                msg["content"] = [{"type": "text", "text": t} for t in texts]
        if m["role"] != "user" or "content" in msg:
            out.append(msg)
    return out


def _texts(blocks: object) -> list[str]:
    if not isinstance(blocks, list):
        return []
    texts = (b.get("text") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    return [t for t in texts if isinstance(t, str) and t and not t.startswith(_BILLING)]


def completion_body(body: Json, ids: list[int], sent: int, room: int) -> Json | None:
    """The completions request that continues ``body``'s answer from ``ids`` (the rendered
    prompt and the text so far) after ``sent`` tokens; None when no token is left."""
    left = min(int(body.get("max_tokens") or 0) - sent, room)
    if left < 1:
        return None
    out: Json = {"model": body.get("model"), "prompt": ids, "max_tokens": left, "stream": True,
                 "stream_options": {"include_usage": True}}  # fmt: skip
    for key in ("temperature", "top_p", "top_k", "cache_salt", "vllm_xargs", "watermarking"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    return out


def stop_reason(finish: object, stop: object) -> tuple[str | None, str | None]:
    """The adapter's ``(stop_reason, stop_sequence)`` of a finish reason (no tools: text)."""
    if finish == "length":
        return "max_tokens", None
    if finish != "stop":
        return None, None
    return ("stop_sequence", stop) if isinstance(stop, str) else ("end_turn", None)


def event(obj: Json) -> bytes:
    """One Anthropic SSE event, framed as vLLM's adapter frames it."""
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class MessagesProgress(StreamProgress):
    """What an Anthropic event stream has given its client so far (see the module docstring):
    ``begun`` once ``message_start`` went out, ``finished`` once ``message_delta`` (the stop
    reason) did."""

    __slots__ = ("block", "blocks", "ended", "input_tokens")

    def __init__(self) -> None:
        super().__init__()
        self.block: int | None = None  # the open text block's index
        self.blocks = 0  # blocks started
        self.ended = False  # message_stop went out
        self.input_tokens: int | None = None

    def note(self, obj: Json) -> None:
        """One event as it goes to the client."""
        kind = obj.get("type")
        if kind == "message_start":
            self.begun = True
            usage = (obj.get("message") or {}).get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
                self.input_tokens = usage["input_tokens"]
        elif kind == "content_block_start":
            self.blocks += 1
            block = obj.get("content_block")
            btype = block.get("type") if isinstance(block, dict) else None
            self.block = obj.get("index") if btype == "text" else None
            if btype != "text":
                self.broken = _BROKEN_BLOCKS.get(str(btype), str(btype))
        elif kind == "content_block_delta":
            self._delta(obj.get("delta"))
        elif kind == "content_block_stop":
            self.block = None
        elif kind == "message_delta":
            self.finished = True
        elif kind == "message_stop":
            self.ended = True

    def _delta(self, delta: object) -> None:
        if not isinstance(delta, dict):
            return
        dtype = delta.get("type")
        if dtype == "text_delta" and isinstance(delta.get("text"), str) and delta["text"]:
            self.parts.append(delta["text"])
            self.tokens += 1
        elif dtype != "text_delta":
            self.broken = _BROKEN_DELTAS.get(str(dtype), str(dtype))

    def end(self, reason: tuple[str, str | None], usage: Json) -> bytes:
        """The events that close the message from here (whichever did not go out yet):
        ``reason`` its stop reason and sequence, ``usage`` the message_delta's."""
        out = b""
        if self.block is not None:
            out += event({"type": "content_block_stop", "index": self.block})
        if not self.finished:
            delta = {"stop_reason": reason[0], "stop_sequence": reason[1]}
            out += event({"type": "message_delta", "delta": delta, "usage": usage})
        if not self.ended:
            out += event({"type": "message_stop"})
        for obj in (orjson.loads(line[6:]) for line in out.split(b"\n") if line[:6] == b"data: "):
            self.note(obj)
        return out


class AsMessages(AsEvents):
    """A completion's chunks re-framed into the client's Anthropic stream (module docstring)."""

    __slots__ = ()
    progress: MessagesProgress

    def __init__(self, progress: MessagesProgress, prompt: int) -> None:
        super().__init__(progress, prompt)

    def _error(self, message: str) -> bytes:
        return event({"type": "error", "error": {"type": "api_error", "message": message}})

    def _text(self, text: str) -> bytes:
        p = self.progress
        out = b""
        if p.block is None:  # the cut came after the text block's stop: a new one
            start = {"type": "content_block_start", "index": p.blocks,
                     "content_block": {"type": "text", "text": ""}}  # fmt: skip
            out += event(start)
            p.note(start)
        delta = {"type": "content_block_delta", "index": p.block,
                 "delta": {"type": "text_delta", "text": text}}  # fmt: skip
        p.note(delta)
        return out + event(delta)

    def _end(self, output_tokens: int) -> bytes:
        reason, sequence = stop_reason(*self._finish)
        usage = {"input_tokens": self.prompt, "output_tokens": output_tokens}
        return self.progress.end((reason or "end_turn", sequence), usage)


class MessagesRoute:
    """``/v1/messages`` streams, for the migrating loop (``reframe.Route``)."""

    label = "a /v1/messages answer"

    def progress(self) -> MessagesProgress:
        return MessagesProgress()

    def refusal(self, origin: Json, progress: MessagesProgress) -> str | None:
        return messages_refusal(origin) or progress.broken

    def end(self, origin: Json, progress: MessagesProgress) -> bytes | None:
        limit = origin.get("max_tokens")
        if not progress.finished and not (isinstance(limit, int) and progress.tokens >= limit):
            return None
        usage = {"input_tokens": progress.input_tokens or 0, "output_tokens": progress.tokens}
        return progress.end(("max_tokens", None), usage)

    def render(self, origin: Json) -> Json:
        out: Json = {"messages": chat_messages(origin), "add_generation_prompt": True}
        if origin.get("chat_template_kwargs"):
            out["chat_template_kwargs"] = origin["chat_template_kwargs"]
        return out

    def body(self, origin: Json, ids: list[int], sent: int, room: int) -> Json | None:
        return completion_body(origin, ids, sent, room)

    def reframer(self, progress: MessagesProgress, prompt: int) -> Rewriter:
        return AsMessages(progress, prompt)


MESSAGES = MessagesRoute()
