"""``/v1/responses`` transforms for reasoning traces, on parsed JSON (no HTTP here).

When the gateway splits (``opts.parser``, see :class:`~.chat.TransformOptions`), a worker
without ``--reasoning-parser`` answers with one ``message`` item whose ``output_text`` holds
``<think>…</think>…``. vLLM with a parser answers instead with a ``reasoning`` item first and
the message after it (``entrypoints/openai/responses/utils.py::build_response_output_items``,
``streaming_events.py``); these functions make the first look like the second:

* :func:`transform_responses_body` — a whole ``response`` object (the non-streaming body, or
  the ``response`` of ``response.created``/``in_progress``/``completed`` events).
* :class:`ResponsesStreamTransformer` — ``event: <type>`` / ``data: <json>`` events one at a
  time. Per message item::

      output_item.added(message) content_part.added(output_text)      held until text comes
      output_text.delta "<think>ab"   → output_item.added(reasoning) content_part.added
                                        (reasoning_text) reasoning_text.delta "ab"
      output_text.delta "</think>Hi"  → reasoning_text.done content_part.done
                                        output_item.done(reasoning)
                                        output_item.added(message) content_part.added
                                        output_text.delta "Hi"
      output_text.done                → output_text.done content_part.done output_item.done

  Items after an inserted reasoning item move one ``output_index`` down; every event is
  numbered again (``sequence_number`` counts from the first event seen), as vLLM numbers
  its own. A message that turns out to hold only reasoning is not sent (vLLM sends none).

Objects are never mutated; unchanged ones are returned as the same object.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gpupool.gateway.transform.chat import TransformOptions
from gpupool.gateway.transform.reasoning import ReasoningParser

Json = dict[str, Any]
Event = tuple[str, Json]

_RESPONSE_EVENTS = ("response.created", "response.in_progress", "response.completed",
                    "response.incomplete", "response.failed")  # fmt: skip


_REWRITTEN = ("response.content_part.done", "response.output_item.done")


def _reasoning_item(text: str | None, item_id: str, status: str | None) -> Json:
    content = [] if text is None else [{"text": text, "type": "reasoning_text"}]
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content,
            "encrypted_content": None, "status": status}  # fmt: skip


def _ev(obj: Json) -> Event:
    return str(obj["type"]), obj


def _new_id() -> str:
    return f"rs_{uuid.uuid4().hex}"


# ---- non-streaming ------------------------------------------------------------------------


def transform_responses_body(
    obj: Json, opts: TransformOptions, ids: list[str] | None = None
) -> Json:
    """A ``response`` object with each message's ``<think>`` part moved to a reasoning item.

    ``ids``: reasoning item ids to use in order (a stream's final ``response`` repeats the ids
    its events announced); fresh ones beyond them. With ``opts.count_tokens``,
    ``usage.output_tokens_details.reasoning_tokens`` is filled in.
    """
    output = obj.get("output")
    if opts.parser is None or not isinstance(output, list):
        return obj
    if any(isinstance(i, dict) and i.get("type") == "reasoning" for i in output):
        return obj  # the worker split already
    new_output: list[Any] = []
    texts: list[str] = []
    pending = list(ids or [])
    for item in output:
        new_output += _split_item(item, opts, texts, pending)
    if _same_items(new_output, output):
        return obj
    out = {**obj, "output": new_output}
    usage = obj.get("usage")
    if opts.count_tokens is not None and isinstance(usage, dict):
        details = usage.get("output_tokens_details")
        count = sum(opts.count_tokens(t) for t in texts)
        new_details = {**(details if isinstance(details, dict) else {}), "reasoning_tokens": count}
        out["usage"] = {**usage, "output_tokens_details": new_details}
    return out


def _same_items(new: list[Any], old: list[Any]) -> bool:
    return len(new) == len(old) and all(a is b for a, b in zip(new, old, strict=True))


def _split_item(item: Any, opts: TransformOptions, texts: list[str], ids: list[str]) -> list[Any]:
    text = _message_text(item)
    parser = opts.new_parser()
    if text is None or parser is None:
        return [item]
    reasoning, content = parser.split(text)
    out: list[Any] = []
    if reasoning:
        texts.append(reasoning)
    if reasoning and opts.include_reasoning:
        out.append(_reasoning_item(reasoning, ids.pop(0) if ids else _new_id(), None))
    if content:
        part = {**item["content"][0], "text": content}
        out.append({**item, "content": [part]})
    return out


def _message_text(item: Any) -> str | None:
    """The text of a message item made of ``output_text`` parts, else None."""
    if not isinstance(item, dict) or item.get("type") != "message":
        return None
    parts = item.get("content")
    if not isinstance(parts, list) or not parts:
        return None
    if not all(isinstance(p, dict) and p.get("type") == "output_text" for p in parts):
        return None
    return "".join(str(p.get("text") or "") for p in parts)


def reasoning_texts(obj: Json) -> list[str]:
    """The reasoning text of every reasoning item of a ``response`` object (for counting)."""
    out: list[str] = []
    for item in obj.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "reasoning":
            out += [str(c.get("text") or "") for c in item.get("content") or []]
    return out


def only_reasoning(obj: Json) -> bool:
    """A ``response`` object whose output is reasoning alone (no message, no tool call): its
    output tokens are all reasoning tokens."""
    output = obj.get("output")
    if not isinstance(output, list):
        return False
    return all(isinstance(i, dict) and i.get("type") == "reasoning" for i in output)


# ---- streaming ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Message:
    """One upstream message item being split."""

    parser: ReasoningParser
    index: int  # upstream output_index
    item: Json
    part: Json | None = None
    reasoning_id: str | None = None
    reasoning: list[str] = field(default_factory=list)
    reasoning_open: bool = False
    opened: bool = False
    content: list[str] = field(default_factory=list)


class ResponsesStreamTransformer:
    """Reshape one ``/v1/responses`` event stream. ``feed(event_type, obj)`` returns the events
    to send in its place (often none or several); ``finish()`` what was still held back."""

    def __init__(self, opts: TransformOptions) -> None:
        self._opts = opts
        self._msg: _Message | None = None
        self._shift = 0  # output items inserted so far
        self._seq: int | None = None
        self._worker_splits = False
        self.reasoning: list[str] = []  # every reasoning text split out, for counting
        self._ids: list[str] = []  # reasoning item ids announced, in order
        self._closed: int | None = None  # upstream index of the message just written again

    @property
    def splitting(self) -> bool:
        return self._opts.parser is not None and not self._worker_splits

    def feed(self, event_type: str, obj: Json) -> list[Event]:
        if self._seq is None and isinstance(obj.get("sequence_number"), int):
            self._seq = obj["sequence_number"]
        if not self.splitting:
            return self._number([(event_type, obj)])
        return self._number(self._route(event_type, obj))

    def finish(self) -> list[Event]:
        """End of stream without ``output_text.done``: close what is open."""
        if self._msg is None:
            return []
        return self._number(self._close_message(None))

    # -- dispatch ------------------------------------------------------------------------------

    def _route(self, event_type: str, obj: Json) -> list[Event]:
        if event_type in _RESPONSE_EVENTS and isinstance(obj.get("response"), dict):
            response = transform_responses_body(obj["response"], self._opts, self._ids)
            if response is not obj["response"]:
                obj = {**obj, "response": response}
            return [(event_type, obj)]
        item = obj.get("item")
        if event_type == "response.output_item.added" and isinstance(item, dict):
            return self._item_added(event_type, obj, item)
        msg = self._msg
        if msg is not None and obj.get("output_index") == msg.index:
            return self._message_event(event_type, obj, msg)
        if event_type in _REWRITTEN and obj.get("output_index") == self._closed:
            return []  # written again by _close_message
        return [(event_type, self._shifted(obj))]

    def _item_added(self, event_type: str, obj: Json, item: Json) -> list[Event]:
        if item.get("type") == "reasoning":
            self._worker_splits = True
            return [(event_type, obj)]
        if item.get("type") != "message" or self._opts.new_parser() is None:
            return [(event_type, self._shifted(obj))]
        parser = self._opts.new_parser()
        assert parser is not None
        self._msg = _Message(parser, int(obj.get("output_index") or 0), item)
        return []  # held until its first text says whether it is reasoning or content

    def _message_event(self, event_type: str, obj: Json, msg: _Message) -> list[Event]:
        if event_type == "response.content_part.added":
            msg.part = obj.get("part") if isinstance(obj.get("part"), dict) else None
            return []
        if event_type == "response.output_text.delta":
            reasoning, content = msg.parser.feed(str(obj.get("delta") or ""))
            return self._text(msg, reasoning, content, obj)
        if event_type == "response.output_text.done":
            return self._close_message(obj)
        if event_type in _REWRITTEN:
            return []  # written again by _close_message
        return [(event_type, self._shifted(obj))]

    # -- the split -------------------------------------------------------------------------------

    def _text(self, msg: _Message, reasoning: str, content: str, src: Json | None) -> list[Event]:
        out: list[Event] = []
        if reasoning:
            self.reasoning.append(reasoning)
            if self._opts.include_reasoning:
                out += self._reasoning_delta(msg, reasoning)
        if content:
            out += self._close_reasoning(msg)
            out += self._open_message(msg)
            msg.content.append(content)
            out.append(("response.output_text.delta", self._text_delta(msg, content, src)))
        return out

    def _reasoning_delta(self, msg: _Message, text: str) -> list[Event]:
        out: list[Event] = []
        if msg.reasoning_id is None:
            msg.reasoning_id, msg.reasoning_open = _new_id(), True
            self._ids.append(msg.reasoning_id)
            self._shift += 1
            index = msg.index + self._shift - 1
            added: Json = {"type": "response.output_item.added", "sequence_number": 0,
                     "output_index": index,
                     "item": _reasoning_item(None, msg.reasoning_id, "in_progress")}  # fmt: skip
            part: Json = {"type": "response.content_part.added", "sequence_number": 0,
                    "output_index": index, "item_id": msg.reasoning_id, "content_index": 0,
                    "part": {"text": "", "type": "reasoning_text"}}  # fmt: skip
            out += [_ev(added), _ev(part)]
        msg.reasoning.append(text)
        delta: Json = {"type": "response.reasoning_text.delta", "item_id": msg.reasoning_id,
                 "sequence_number": 0, "output_index": msg.index + self._shift - 1,
                 "content_index": 0, "delta": text}  # fmt: skip
        return [*out, _ev(delta)]

    def _close_reasoning(self, msg: _Message) -> list[Event]:
        if not msg.reasoning_open or msg.reasoning_id is None:
            return []
        msg.reasoning_open = False
        text, index, rid = "".join(msg.reasoning), msg.index + self._shift - 1, msg.reasoning_id
        part = {"text": text, "type": "reasoning_text"}
        events: list[Json] = [
            {"type": "response.reasoning_text.done", "item_id": rid, "sequence_number": 0,
             "output_index": index, "content_index": 0, "text": text},
            {"type": "response.content_part.done", "sequence_number": 0, "item_id": rid,
             "output_index": index, "content_index": 0, "part": part},
            {"type": "response.output_item.done", "sequence_number": 0, "output_index": index,
             "item": _reasoning_item(text, rid, "completed")},
        ]  # fmt: skip
        return [_ev(e) for e in events]

    def _open_message(self, msg: _Message) -> list[Event]:
        if msg.opened:
            return []
        msg.opened = True
        index, item_id = msg.index + self._shift, msg.item.get("id")
        added: Json = {"type": "response.output_item.added", "sequence_number": 0,
                 "output_index": index, "item": msg.item}  # fmt: skip
        part = msg.part or {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        part_added: Json = {"type": "response.content_part.added", "sequence_number": 0,
                      "output_index": index, "item_id": item_id, "content_index": 0,
                      "part": part}  # fmt: skip
        return [_ev(added), _ev(part_added)]

    def _text_delta(self, msg: _Message, text: str, src: Json | None) -> Json:
        base = src if src is not None and src.get("delta") == text else None
        if base is not None:
            return self._shifted(base)
        return {"type": "response.output_text.delta", "sequence_number": 0,
                "content_index": 0, "output_index": msg.index + self._shift,
                "item_id": msg.item.get("id"), "delta": text, "logprobs": []}  # fmt: skip

    def _close_message(self, done: Json | None) -> list[Event]:
        msg = self._msg
        assert msg is not None
        self._msg, self._closed = None, msg.index
        reasoning, content = msg.parser.finish()
        out = self._text(msg, reasoning, content, None)
        out += self._close_reasoning(msg)
        if not msg.opened:
            if msg.reasoning_id is not None:
                self._shift -= 1  # the reasoning item took the message's place
                return out
            out += self._open_message(msg)  # nothing at all: an empty message, as upstream
        return out + self._message_done(msg, done)

    def _message_done(self, msg: _Message, done: Json | None) -> list[Event]:
        text, index, item_id = "".join(msg.content), msg.index + self._shift, msg.item.get("id")
        part = {**(msg.part or {"type": "output_text", "annotations": [], "logprobs": []}),
                "text": text}  # fmt: skip
        item = {**msg.item, "content": [part] if text else [], "status": "completed"}
        base = {"sequence_number": 0, "output_index": index, "item_id": item_id,
                "content_index": 0}  # fmt: skip
        events: list[Json] = [
            {**(done or {}), **base, "type": "response.output_text.done", "text": text},
            {**base, "type": "response.content_part.done", "part": part},
            {"type": "response.output_item.done", "sequence_number": 0, "output_index": index,
             "item": item},
        ]  # fmt: skip
        if done is None:
            events[0].setdefault("logprobs", [])
        return [_ev(e) for e in events]

    # -- bookkeeping -------------------------------------------------------------------------------

    def _shifted(self, obj: Json) -> Json:
        index = obj.get("output_index")
        if not self._shift or not isinstance(index, int):
            return obj
        return {**obj, "output_index": index + self._shift}

    def _number(self, events: list[Event]) -> list[Event]:
        if self._seq is None:
            return events
        out: list[Event] = []
        for event_type, obj in events:
            if "sequence_number" in obj:
                if obj["sequence_number"] != self._seq:
                    obj = {**obj, "sequence_number": self._seq}
                self._seq += 1
            out.append((event_type, obj))
        return out
