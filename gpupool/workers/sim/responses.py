"""vLLM's streamed ``/v1/responses`` over the simulator's chat stream.

vLLM 0.32 streams a Responses answer without tools through its simple path
(``entrypoints/openai/responses/streaming_events.py``); the simulator frames the chat stream's
chunks the same way, one ``event: <type>\\ndata: <json>`` each, ``sequence_number`` from 0:

* ``response.created`` and ``response.in_progress`` with the response object in progress
  (``output`` empty, ``usage`` null);
* per item, ``response.output_item.added`` and ``response.content_part.added``, a delta per
  token (``response.reasoning_text.delta`` in a ``reasoning`` item, with ``--reasoning-parser``;
  ``response.output_text.delta`` in a ``message`` item), then the text's ``.done``,
  ``response.content_part.done`` and ``response.output_item.done``;
* ``response.completed`` with the whole response (``render.responses_body``: the same item
  ids, ``incomplete`` at ``max_output_tokens``, usage); a chat error chunk becomes an
  ``error`` event and ends the stream.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson

from gpupool.workers.sim import render

Json = dict[str, Any]

_TEXT = {"message": ("output_text", "response.output_text"),
         "reasoning": ("reasoning_text", "response.reasoning_text")}  # fmt: skip


class _Events:
    """The Responses events of one chat stream (module docstring)."""

    def __init__(self, rid: str, keep: Callable[[bytes], None]) -> None:
        self.rid = rid
        self.keep = keep
        self.seq = 0
        self.started = False
        self.kind: str | None = None  # the open item's type
        self.index = 0  # the next item's output_index
        self.texts: dict[str, str] = {}
        self.reasoning_tokens = 0
        self.finish = "stop"
        self.head: tuple[int, str] = (0, "")  # created, model
        self.usage = (0, 0)
        self.failed = False  # an error event went: nothing after it

    def _event(self, obj: Json) -> bytes:
        obj["sequence_number"] = self.seq
        self.seq += 1
        return b"event: " + str(obj["type"]).encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    def _item_id(self, kind: str) -> str:
        return ("rs_" if kind == "reasoning" else "msg_") + self.rid[5:]  # as render's

    def feed(self, payload: bytes) -> list[bytes]:
        if self.failed:
            return []
        if payload == b"[DONE]":
            return self.end()
        chunk = orjson.loads(payload)
        if "error" in chunk:
            self.failed = True
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            obj = {"type": "error", "code": str(error.get("code")), "param": None,
                   "message": str(error.get("message"))}  # fmt: skip
            return [self._event(obj)]
        out = [] if self.started else self._start(chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and not chunk.get("choices"):
            self.usage = (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        for c in chunk.get("choices") or []:
            self.finish = c.get("finish_reason") or self.finish
            delta = c.get("delta") or {}
            if delta.get("reasoning"):
                self.reasoning_tokens += 1
                out += self.delta("reasoning", delta["reasoning"])
            if delta.get("content"):
                out += self.delta("message", delta["content"])
        return out

    def _start(self, chunk: Json) -> list[bytes]:
        self.started = True
        self.head = (int(chunk.get("created", 0)), str(chunk.get("model", "")))
        response = self._response()
        response.update(output=[], status="in_progress", usage=None, incomplete_details=None)
        return [self._event({"type": "response.created", "response": response}),
                self._event({"type": "response.in_progress", "response": response})]  # fmt: skip

    def _response(self) -> Json:
        text = (self.texts.get("reasoning"), self.texts.get("message"))
        tokens = (self.usage[0], self.usage[1], self.reasoning_tokens)
        body = render.responses_body(self.rid, *self.head, text, self.finish, tokens)
        out: Json = orjson.loads(body)
        return out

    def delta(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.kind == kind else [*self.close(), *self._open(kind)]
        self.texts[kind] = self.texts.get(kind, "") + text
        prefix = _TEXT[kind][1]
        obj: Json = {"type": prefix + ".delta", "content_index": 0, "delta": text,
                     "item_id": self._item_id(kind), "output_index": self.index}  # fmt: skip
        if kind == "message":
            obj["logprobs"] = []
        return [*out, self._event(obj)]

    def _open(self, kind: str) -> list[bytes]:
        self.kind = kind
        item: Json = {"id": self._item_id(kind), "type": kind, "status": "in_progress"}
        if kind == "message":
            item.update(content=[], role="assistant", phase=None)
            part: Json = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        else:
            item["summary"] = []
            part = {"text": "", "type": "reasoning_text"}
        where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
        return [self._event({"type": "response.output_item.added", "item": item,
                             "output_index": self.index}),
                self._event({"type": "response.content_part.added", **where,
                             "part": part})]  # fmt: skip

    def close(self) -> list[bytes]:
        kind = self.kind
        if kind is None:
            return []
        text = self.texts.get(kind, "")
        part_type, prefix = _TEXT[kind]
        where = {"item_id": self._item_id(kind), "output_index": self.index, "content_index": 0}
        done: Json = {"type": prefix + ".done", **where, "text": text}
        part: Json = {"text": text, "type": part_type}
        if kind == "message":
            done["logprobs"] = []
            part.update(annotations=[], logprobs=None)
        item = next(i for i in self._response()["output"] if i["type"] == kind)
        out = [self._event(done),
               self._event({"type": "response.content_part.done", **where, "part": part}),
               self._event({"type": "response.output_item.done", "item": item,
                            "output_index": self.index})]  # fmt: skip
        self.kind = None
        self.index += 1
        return out

    def end(self) -> list[bytes]:
        out = self.close()
        body = self._response()
        self.keep(orjson.dumps(body))
        return [*out, self._event({"type": "response.completed", "response": body})]


async def response_events(
    chunks: AsyncGenerator[bytes, None], rid: str, keep: Callable[[bytes], None]
) -> AsyncGenerator[bytes, None]:
    """The chat stream's chunks (usage included) as vLLM's Responses events; ``keep`` gets the
    final response object (a stored response)."""
    events = _Events(rid, keep)
    try:
        async for raw in chunks:
            for line in raw.split(b"\n"):
                if line.startswith(b"data: "):
                    for e in events.feed(line[6:]):
                        yield e
    finally:
        await chunks.aclose()
