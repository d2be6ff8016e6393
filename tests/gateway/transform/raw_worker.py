"""A worker stand-in for vLLM 0.32 without ``--reasoning-parser``: its ``/v1/messages`` and
``/v1/responses`` answers carry the model's ``<think>…</think>`` as text, in the event shapes a
real worker writes (copied from one), cut into pieces of one to three characters. It records
every body it receives.

* ``chat_template_kwargs.enable_thinking: false`` gives the answer without its thought (the
  template wrote an empty one), as a Qwen3 template does.
* ``thinking.budget_tokens`` gets vLLM's 400: a worker without a reasoning parser or config
  cannot end a thought at a budget. Streamed, vLLM answers 200 and then only an ``error``
  event in pydantic's words (its adapter cannot read the chat's error chunk).
* ``/tokenize`` counts words, so the gateway's reasoning counts are known numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.hostile_tools import serve_in_thread
from tests.support.procs import free_port

SCRIPT = "<think>Let me see: 2 plus 2.</think>It is 4."
THOUGHT, ANSWER = "Let me see: 2 plus 2.", "It is 4."
NO_BUDGET = (
    "thinking_token_budget is set but reasoning_config is not configured. Please set "
    "--reasoning-parser and/or --reasoning-config to use thinking_token_budget."
)

STREAM_REFUSAL = (
    "2 validation errors for ChatCompletionStreamResponse\nmodel\n  Field required "
    "[type=missing, input_value={'error': {'message': 'th...: None, 'code': 400}}, "
    "input_type=dict]"
)

Json = dict[str, Any]


def pieces(text: str) -> list[str]:
    sizes, i = (1, 2, 3), 0
    out: list[str] = []
    while i < len(text):
        n = sizes[len(out) % 3]
        out.append(text[i : i + n])
        i += n
    return out


def _event(kind: str, obj: Json) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(obj)}\n\n".encode()


class RawWorker:
    def __init__(self, model: str = "m", window: int = 4096) -> None:
        self.model = model
        self.window = window
        self.bodies: list[tuple[str, Json]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope: Json, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        body: Json = json.loads(raw or b"{}") if scope["method"] == "POST" else {}
        if scope["method"] == "POST":
            self.bodies.append((path, body))
        status, out = self._answer(path, body)
        if isinstance(out, list):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            for chunk in out:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": json.dumps(out).encode()})

    def _answer(self, path: str, body: Json) -> tuple[int, Json | list[bytes]]:
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model",
                                                     "max_model_len": self.window}]}  # fmt: skip
        if path == "/tokenize":
            words = len(str(body.get("prompt", "")).split())
            return 200, {"count": words, "max_model_len": self.window, "tokens": [1] * words}
        if path == "/v1/messages/count_tokens":
            return 200, {"input_tokens": 10}
        text = SCRIPT
        kwargs = body.get("chat_template_kwargs") or {}
        if kwargs.get("enable_thinking") is False:
            text = ANSWER
        if path == "/v1/messages":
            thinking = body.get("thinking") or {}
            if thinking.get("type") == "enabled":
                if body.get("stream"):  # vLLM's adapter: a 200, then pydantic's words
                    error = {"type": "internal_error", "message": STREAM_REFUSAL}
                    return 200, [_event("error", {"type": "error", "error": error})]
                error = {"type": "BadRequestError", "message": NO_BUDGET}
                return 400, {"type": "error", "error": error}
            return 200, self._messages(text, bool(body.get("stream")))
        if path == "/v1/responses":
            limit = body.get("max_output_tokens")  # a piece is a token
            text = "".join(pieces(text)[:limit]) if isinstance(limit, int) else text
            return 200, self._responses(text, bool(body.get("stream")))
        return 200, {}

    def _messages(self, text: str, stream: bool) -> Json | list[bytes]:
        usage = {"input_tokens": 10, "output_tokens": len(pieces(text))}
        if not stream:
            return {"id": "chatcmpl-1", "type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": text}], "model": self.model,
                    "stop_reason": "end_turn", "usage": usage}  # fmt: skip
        start: Json = {"id": "chatcmpl-1", "type": "message", "role": "assistant", "content": [],
                 "model": self.model, "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": 10, "output_tokens": 0}}  # fmt: skip
        out = [_event("message_start", {"type": "message_start", "message": start}),
               _event("content_block_start", {"type": "content_block_start",
                                              "content_block": {"type": "text", "text": ""},
                                              "index": 0})]  # fmt: skip
        for p in pieces(text):
            delta = {"type": "text_delta", "text": p}
            out.append(_event("content_block_delta", {"type": "content_block_delta",
                                                      "delta": delta, "index": 0}))  # fmt: skip
        stop = {"stop_reason": "end_turn", "stop_sequence": None}
        return [*out, _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event("message_delta", {"type": "message_delta", "delta": stop, "usage": usage}),
                _event("message_stop", {"type": "message_stop"})]  # fmt: skip

    def _responses(self, text: str, stream: bool) -> Json | list[bytes]:
        part: Json = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        item = {"id": "msg_1", "content": [part], "role": "assistant", "status": "completed",
                "type": "message"}  # fmt: skip
        usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": len(pieces(text)),
                 "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
                 "total_tokens": 10 + len(pieces(text))}  # fmt: skip
        done: Json = {"id": "resp_1", "object": "response", "model": self.model,
                      "created_at": 1, "status": "completed", "output": [item],
                      "usage": usage}  # fmt: skip
        if not stream:
            return done
        begun = {**done, "status": "in_progress", "output": [], "usage": None}
        seq = iter(range(1000))

        def ev(kind: str, **obj: Any) -> bytes:
            return _event(kind, {**obj, "sequence_number": next(seq), "type": kind})

        base = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
        out = [ev("response.created", response=begun), ev("response.in_progress", response=begun),
               ev("response.output_item.added", output_index=0,
                  item={**item, "content": [], "status": "in_progress"}),
               ev("response.content_part.added", part={**part, "text": ""}, **base)]  # fmt: skip
        out += [ev("response.output_text.delta", delta=p, logprobs=[], **base)
                for p in pieces(text)]  # fmt: skip
        return [*out, ev("response.output_text.done", text=text, logprobs=[], **base),
                ev("response.content_part.done", part=part, **base),
                ev("response.output_item.done", output_index=0, item=item),
                ev("response.completed", response=done)]  # fmt: skip

    @contextmanager
    def running(self) -> Iterator[RawWorker]:
        with serve_in_thread(self, self.port):
            yield self
