"""Continuing a streamed ``/v1/responses`` answer on another worker (request migration).

vLLM's Responses server could continue a final assistant message, but the client's stream
could not simply go on with its events (its own response and item ids, sequence numbers from
0, a second ``response.created``, a ``response.completed`` with only the rest): so a Responses
answer goes on as a completion of vLLM's own rendering, as a ``/v1/messages`` answer does
(``messages_continuation.py``, ``pipeline/continue_events.py``)::

    the Responses request ── chat_messages (vLLM's ``construct_input_messages``: instructions
                             first, then the input) ── new worker's /tokenize ──▶ prompt ids
    the text so far       ── /tokenize (no special tokens) ──────────────────▶ its ids
    POST /v1/completions {prompt: both, the request's sampling parameters and seed,
                          max_tokens: max_output_tokens less the tokens sent} (stream, usage)
    its text_completion chunks ── AsResponses ──▶ the client's Responses events

* :func:`responses_refusal` says why a request cannot be continued as text: tools, reasoning,
  structured output, logprobs, images or files, input items other than messages, a stored
  conversation (``previous_response_id``), ``background``.
* :class:`ResponsesProgress` reads the events the client is given (vLLM's simple streaming
  path, ``streaming_events.py``): the response object of ``response.created``, the last
  ``sequence_number``, the items done, the open message item and its text, and what makes it
  impossible to continue (a reasoning or tool-call item).
* :class:`AsResponses` re-frames the completion's chunks: ``response.output_text.delta`` on the
  open message item (a new message item when none is open), numbered on from the last event;
  then ``output_text.done``, ``content_part.done`` and ``output_item.done`` with the item's
  whole text, and one ``response.completed`` whose response is the first one's with the whole
  output, its status (``incomplete`` at ``max_output_tokens``, as vLLM) and usage counted once
  (``input_tokens`` the rendered prompt's, ``output_tokens`` the tokens the client had plus the
  new worker's).

A token is counted per ``output_text.delta`` event (vLLM sends one per engine step): an
estimate where a worker merges steps, as for chat (docs/migration.md).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gpupool.gateway.transform.reframe import AsEvents, Rewriter, StreamProgress

Json = dict[str, Any]

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")
_LOGPROBS = "message.output_text.logprobs"
# completion fields a Responses request's sampling maps to, as they are named there
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
             "skip_special_tokens", "include_stop_str_in_output", "vllm_xargs", "watermarking",
             "cache_salt")  # fmt: skip
_FINAL = ("response.completed", "response.incomplete", "response.failed")


def responses_refusal(body: Json) -> str | None:
    """Why a Responses answer cannot go on as plain text once it has begun; None when it can
    (each reason is in docs/migration.md)."""
    if body.get("tools"):
        return "tools"
    if body.get("reasoning") is not None:
        return "reasoning"  # an effort renders otherwise, and the parser splits the output
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if body.get("structured_outputs") is not None or (fmt is not None and not _plain(fmt)):
        return "structured_outputs"
    include = body.get("include")
    if (isinstance(include, list) and _LOGPROBS in include) or body.get("top_logprobs"):
        return "logprobs"
    for key in ("previous_response_id", "previous_input_messages", "background", "prompt",
                "kv_transfer_params", "ec_transfer_params"):  # fmt: skip
        if body.get(key):
            return key
    return _input_refusal(body.get("input"))


def _plain(fmt: object) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _input_refusal(items: object) -> str | None:
    if isinstance(items, str):
        return None
    if not isinstance(items, list) or not items:
        return "messages"
    for item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            return "messages"  # a tool call, its output, a reasoning item, a reference...
        if item.get("role") not in _ROLES or item.get("status") in ("in_progress", "incomplete"):
            return "messages"  # a partial final message: vLLM continues it, not a new turn
        content = item.get("content")
        if not isinstance(content, str) and not _text_parts(content):
            return "media"
    return None


def _text_parts(content: object) -> bool:
    return (
        isinstance(content, list)
        and bool(content)
        and all(
            isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
            for p in content
        )
    )


def chat_messages(body: Json) -> list[Json]:
    """The chat messages vLLM's Responses server makes of a text-only request
    (``construct_input_messages`` in vLLM 0.32): ``instructions`` as the system message first;
    a string input as one user message; each message item as a chat message (an assistant's
    content its first part's text, as vLLM reads it; others' text parts as ``text`` parts)."""
    out: list[Json] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items:
        content = item["content"]
        if isinstance(content, list) and item["role"] == "assistant":
            content = content[0]["text"]
        elif isinstance(content, list):
            content = [{"type": "text", "text": p["text"]} for p in content]
        message = {"role": item["role"], "content": content}
        if isinstance(item.get("name"), str):
            message["name"] = item["name"]
        out.append(message)
    return out


def completion_body(body: Json, ids: list[int], sent: int, room: int) -> Json | None:
    """The completions request that continues ``body``'s answer from ``ids`` (the rendered
    prompt and the text so far) after ``sent`` tokens; None when no token is left.
    ``max_output_tokens`` unset: the window left, as vLLM's default."""
    limit = body.get("max_output_tokens")
    left = min(limit - sent, room) if isinstance(limit, int) else room
    if left < 1:
        return None
    out: Json = {"model": body.get("model"), "prompt": ids, "max_tokens": left, "stream": True,
                 "stream_options": {"include_usage": True}}  # fmt: skip
    for key in _SAMPLING:
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def event(obj: Json) -> bytes:
    """One Responses SSE event, framed as vLLM frames it."""
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class ResponsesProgress(StreamProgress):
    """What a Responses event stream has given its client so far (see the module docstring).
    ``finished``: its final event (``response.completed``) went out."""

    __slots__ = ("item", "items", "outputs", "response", "seq")

    def __init__(self) -> None:
        super().__init__()
        self.response: Json = {}  # response.created's response object
        self.seq = -1  # the last sequence_number sent
        self.items: list[Json] = []  # output items done
        self.outputs = 0  # output items added
        # the open message item: id, output_index, content_index (None: no part yet), its
        # texts, and whether its text and its part are done
        self.item: Json | None = None

    def note(self, obj: Json) -> None:
        """One event as it goes to the client."""
        self.begun = True
        seq = obj.get("sequence_number")
        if isinstance(seq, int):
            self.seq = seq
        kind = str(obj.get("type"))
        if kind in ("response.created", "response.in_progress"):
            response = obj.get("response")
            self.response = response if isinstance(response, dict) else self.response
        elif kind in _FINAL:
            self.finished = True
        elif kind.startswith("response.reasoning"):
            self.broken = "reasoning"
        else:
            self._item_event(kind, obj)

    def _item_event(self, kind: str, obj: Json) -> None:
        if kind == "response.output_item.added":
            self._added(obj.get("item"), obj.get("output_index"))
        elif kind == "response.content_part.added":
            part = obj.get("part")
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype != "output_text" or self.item is None:
                self.broken = self.broken or str(ptype)
            else:
                self.item["content_index"] = obj.get("content_index", 0)
        elif kind == "response.output_text.delta":
            self._delta(obj)
        elif kind == "response.output_text.done" and self.item is not None:
            self.item["done"] = True
        elif kind == "response.content_part.done" and self.item is not None:
            self.item["part_done"] = True
        elif kind == "response.output_item.done":
            if isinstance(obj.get("item"), dict):
                self.items.append(obj["item"])
            self.item = None

    def said_all(self) -> bool:
        """Whether the message's text is done: vLLM's simple path ends a text part or a
        message item only at the answer's end (or before a reasoning or tool item, which
        breaks it anyway)."""
        if self.item is not None:
            return bool(self.item["done"])
        return bool(self.items) and self.items[-1].get("type") == "message"

    def _added(self, item: object, index: object) -> None:
        self.outputs += 1
        itype = item.get("type") if isinstance(item, dict) else None
        if itype == "message" and isinstance(item, dict):
            self.item = {"id": item.get("id"), "output_index": index, "content_index": None,
                         "texts": [], "done": False, "part_done": False}  # fmt: skip
        elif itype == "reasoning":
            self.broken = "reasoning"
        else:
            self.broken = "tool_call" if "call" in str(itype) else str(itype)

    def _delta(self, obj: Json) -> None:
        text = obj.get("delta")
        if obj.get("logprobs"):
            self.broken = "logprobs"
        if isinstance(text, str) and text and self.item is not None:
            self.parts.append(text)
            self.item["texts"].append(text)
            self.tokens += 1

    # ---- the gateway's own events, numbered on ---------------------------------------

    def send(self, obj: Json) -> bytes:
        """``obj`` as the next event: numbered after the last, noted, framed."""
        obj["sequence_number"] = self.seq + 1
        self.note(obj)
        return event(obj)

    def open(self) -> bytes:
        """A message item and its text part, where none is open (the cut came before the
        first text or after an item ended)."""
        out = b""
        if self.item is None:
            item_id = f"msg_{uuid.uuid4().hex}"
            item: Json = {"id": item_id, "content": [], "role": "assistant",
                          "status": "in_progress", "type": "message", "phase": None}  # fmt: skip
            out += self.send({"item": item, "output_index": self.outputs,
                              "type": "response.output_item.added"})  # fmt: skip
        assert self.item is not None
        if self.item["content_index"] is None:
            part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            out += self.send({"content_index": 0, "item_id": self.item["id"],
                              "output_index": self.item["output_index"], "part": part,
                              "type": "response.content_part.added"})  # fmt: skip
        return out

    def delta(self, text: str) -> bytes:
        """One token's ``output_text.delta`` on the open message item."""
        out = self.open()
        item = self.item
        assert item is not None
        return out + self.send({"content_index": item["content_index"], "delta": text,
                                "item_id": item["id"], "logprobs": [],
                                "output_index": item["output_index"],
                                "type": "response.output_text.delta"})  # fmt: skip

    def end(self, incomplete: bool, usage: Json | None) -> bytes:
        """The events that end the response from here (whichever did not go out yet): the open
        item closed with its whole text, then ``response.completed`` with the whole output."""
        out = b""
        item = self.item
        if item is not None:
            text = "".join(item["texts"])
            where = {"item_id": item["id"], "output_index": item["output_index"]}
            part: Json = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            at = {**where, "content_index": item["content_index"]}
            if item["content_index"] is not None and not item["done"]:
                out += self.send({**at, "logprobs": [], "text": text,
                                  "type": "response.output_text.done"})  # fmt: skip
            if item["content_index"] is not None and not item["part_done"]:  # (a cut between)
                out += self.send({**at, "part": part, "type": "response.content_part.done"})
            done = {"id": item["id"], "content": [part] if text else [], "role": "assistant",
                    "status": "completed", "type": "message", "phase": None}  # fmt: skip
            out += self.send({"item": done, "output_index": item["output_index"],
                              "type": "response.output_item.done"})  # fmt: skip
        if not self.finished:
            response = {**self.response, "output": list(self.items), "usage": usage,
                        "status": "incomplete" if incomplete else "completed",
                        "incomplete_details": {"reason": "max_output_tokens"}
                        if incomplete else None}  # fmt: skip
            out += self.send({"response": response, "type": "response.completed"})
        return out


class AsResponses(AsEvents):
    """A completion's chunks re-framed into the client's Responses stream (module docstring)."""

    __slots__ = ()
    progress: ResponsesProgress

    def __init__(self, progress: ResponsesProgress, prompt: int) -> None:
        super().__init__(progress, prompt)

    def _text(self, text: str) -> bytes:
        return self.progress.delta(text)

    def _end(self, output_tokens: int) -> bytes:
        cached = 0
        details = (self.usage or {}).get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = min(details["cached_tokens"], self.prompt)
        usage = {"input_tokens": self.prompt, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": output_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.prompt + output_tokens}  # fmt: skip
        return self.progress.end(self._finish[0] == "length", usage)

    def _error(self, message: str) -> bytes:
        error = {"code": "502", "message": message, "param": None, "type": "error"}
        return self.progress.send(error)


class ResponsesRoute:
    """``/v1/responses`` streams, for the migrating loop (``reframe.Route``)."""

    label = "a /v1/responses answer"

    def progress(self) -> ResponsesProgress:
        return ResponsesProgress()

    def refusal(self, origin: Json, progress: ResponsesProgress) -> str | None:
        return responses_refusal(origin) or progress.broken

    def end(self, origin: Json, progress: ResponsesProgress) -> bytes | None:
        """Every event went out (nothing), or every token did (the rest of the end; its usage
        is not known without a worker: none)."""
        if progress.finished:
            return b""
        limit = origin.get("max_output_tokens")
        full = isinstance(limit, int) and progress.tokens >= limit
        if full or progress.said_all():
            return progress.end(full, None)
        return None

    def render(self, origin: Json) -> Json:
        out: Json = {"messages": chat_messages(origin), "add_generation_prompt": True}
        if origin.get("chat_template_kwargs"):
            out["chat_template_kwargs"] = origin["chat_template_kwargs"]
        return out

    def body(self, origin: Json, ids: list[int], sent: int, room: int) -> Json | None:
        return completion_body(origin, ids, sent, room)

    def reframer(self, progress: ResponsesProgress, prompt: int) -> Rewriter:
        return AsResponses(progress, prompt)


RESPONSES = ResponsesRoute()
