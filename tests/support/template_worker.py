"""A fake vLLM whose chat template rewrites every continued final message (migration tests).

Its model always answers ``ANSWER`` (piece by piece, one piece a token event), and tokenizes
one character a token (the id: the character's code point), rendering a chat as
``<|role|>content`` per message plus ``<|assistant|>`` for the generation prompt. It:

* streams a new chat answer's first ``--die-after`` pieces, then exits (as ``kill -9``: the
  connection breaks mid-body);
* streams a new completion (a text prompt ending ``<|assistant|>``) the same way;
* refuses a chat with ``continue_final_message`` with vLLM's 400 for a template that rewrote
  the final message;
* answers ``/tokenize`` (chat and prompt forms) and a streamed ``/v1/completions`` whose prompt
  is token ids (or text): the rendered chat and a prefix of ``ANSWER``, continued with the rest
  of it (``MISMATCH`` when the ids are not such a prompt);
* with ``return_token_ids``, writes the ids as vLLM 0.32 does (the prompt's in the first
  chunk, each event's own; ``null`` without the flag), including a chat chunk with an empty
  delta and the ids of a piece whose text it holds back (``" me"``: ``" m"``'s ids alone, then
  the text with ``"e"``'s); ``--no-token-ids`` writes no such keys, as an older vLLM;
* streams a ``/v1/messages`` answer as vLLM's Anthropic adapter frames it (``message_start``,
  one text block, a ``text_delta`` a piece) and exits after ``--die-after`` pieces likewise;
  its chat form for ``/tokenize`` is the adapter's (system first);
* streams a ``/v1/responses`` answer as vLLM's Responses server frames it (``response.created``,
  ``response.in_progress``, one message item and text part, an ``output_text.delta`` a piece,
  numbered from 0) and exits after ``--die-after`` pieces likewise; a whole ``/v1/responses``
  answer it cuts mid-body, or with ``--die-after 0`` answers whole (``WHOLE``);
* keeps every request it took, for ``GET /stats``.

Run it as a process::

    python -m tests.support.template_worker --port 8123 --model m --die-after 7
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ANSWER = ["<think>", "Let", " me", " see", ".", "</think>", "The", " answer", " is", " forty",
          "-two", ",", " said", " the", " worker", "."]  # fmt: skip
FULL = "".join(ANSWER)
REFUSAL = (
    "continue_final_message is set but the final message does not appear in the chat after "
    "applying the chat template! This can happen if the chat template deletes portions of the "
    "final message."
)


def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    out = "".join(f"<|{m['role']}|>{_text(m.get('content'))}" for m in messages)
    return out + ("<|assistant|>" if generation_prompt else "")


def _text(content: object) -> str:
    """A message's text; text parts joined by a line end, as vLLM renders them."""
    if isinstance(content, list):
        return "\n".join(str(p["text"]) for p in content)
    return str(content or "")


def rest_after(text: str) -> list[str]:
    """The pieces of ``ANSWER`` after its prefix ``text`` (the first one cut where it is)."""
    out, at = [], 0
    for piece in ANSWER:
        end = at + len(piece)
        if end > len(text):
            out.append(piece[max(0, len(text) - at) :])
        at = end
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    opts: argparse.Namespace
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            card = {"id": self.opts.model, "object": "model", "max_model_len": self.opts.window}
            self._json(200, {"object": "list", "data": [card]})
        elif self.path == "/stats":
            with self.lock:
                self._json(200, {"seen": self.seen})
        else:
            self._json(404, {"error": {"message": "Not Found", "code": 404}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        with self.lock:
            self.seen.append({"path": self.path, "body": body})
        if self.path == "/tokenize":
            self._tokenize(body)
        elif self.path == "/v1/chat/completions" and body.get("continue_final_message"):
            self._json(400, {"error": {"message": REFUSAL, "type": "BadRequestError",
                                       "param": None, "code": 400}})  # fmt: skip
        elif self.path == "/v1/chat/completions":
            self._chat(body)
        elif self.path == "/v1/completions":
            self._completion(body)
        elif self.path == "/v1/messages":
            self._messages(body)
        elif self.path == "/v1/responses":
            self._responses(body)
        else:
            self._json(404, {"error": {"message": "Not Found", "code": 404}})

    def _tokenize(self, body: dict[str, Any]) -> None:
        if "messages" in body:
            text = render(body["messages"], body.get("add_generation_prompt", True))
        else:
            text = str(body["prompt"])
        tokens = [ord(c) for c in text]
        self._json(200, {"count": len(tokens), "max_model_len": self.opts.window,
                         "tokens": tokens})  # fmt: skip

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _event(self, obj: object) -> None:
        if not isinstance(obj, bytes):  # compact, as vLLM (pydantic) writes it
            obj = json.dumps(obj, separators=(",", ":")).encode()
        data = b"data: " + obj + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _ids(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        """The ``token_ids`` member of a choice, as vLLM writes it (none: ``--no-token-ids``)."""
        if self.opts.no_token_ids:
            return {}
        return {"token_ids": [ord(c) for c in text] if body.get("return_token_ids") else None}

    def _chat(self, body: dict[str, Any]) -> None:
        self._start_stream()
        head = {"id": "chatcmpl-first", "object": "chat.completion.chunk", "created": 1,
                "model": self.opts.model}  # fmt: skip
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}  # fmt: skip
        first: dict[str, Any] = {**head, "choices": [role]}
        if not self.opts.no_token_ids:
            asked = body.get("return_token_ids")
            prompt = [ord(c) for c in render(body["messages"], True)]
            first |= {"prompt_token_ids": prompt if asked else None, "prompt_text": None}
        self._event(first)
        for piece in ANSWER[: self.opts.die_after]:
            held = piece == " me" and body.get("return_token_ids") and not self.opts.no_token_ids
            if held:  # vLLM holds " m" back (its chunk: the ids alone), then sends " me"
                alone = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None,
                         **self._ids(body, " m")}  # fmt: skip
                self._event({**head, "choices": [alone]})
            choice = {"index": 0, "delta": {"content": piece}, "logprobs": None,
                      "finish_reason": None, **self._ids(body, "e" if held else piece)}  # fmt: skip
            self._event({**head, "choices": [choice]})
        os._exit(1)  # mid-body: the gateway reads a connection that broke

    def _anthropic(self, obj: dict[str, Any]) -> None:
        data = b"event: %s\ndata: %s\n\n" % (obj["type"].encode(), json.dumps(obj).encode())
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _messages(self, body: dict[str, Any]) -> None:
        self._start_stream()
        usage = {"input_tokens": 9, "output_tokens": 0}
        message = {"id": "msg-first", "type": "message", "role": "assistant", "content": [],
                   "model": self.opts.model, "stop_reason": None, "stop_sequence": None,
                   "usage": usage}  # fmt: skip
        self._anthropic({"type": "message_start", "message": message})
        self._anthropic({"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}})  # fmt: skip
        for piece in ANSWER[: self.opts.die_after]:
            delta = {"type": "text_delta", "text": piece}
            self._anthropic({"type": "content_block_delta", "index": 0, "delta": delta})
        os._exit(1)  # mid-body: the gateway reads a connection that broke

    def _responses(self, body: dict[str, Any]) -> None:
        if not body.get("stream"):
            self._whole_response(body)
            return
        self._start_stream()
        response = {"id": body.get("request_id") or "resp_first", "object": "response",
                    "created_at": 1, "model": self.opts.model, "output": [],
                    "status": "in_progress", "usage": None, "error": None,
                    "incomplete_details": None, "instructions": body.get("instructions"),
                    "max_output_tokens": body.get("max_output_tokens"), "metadata": None,
                    "parallel_tool_calls": True, "temperature": body.get("temperature", 1.0),
                    "tool_choice": "auto", "tools": [], "top_p": 1.0}  # fmt: skip
        item = {"id": "msg_first", "content": [], "role": "assistant", "status": "in_progress",
                "type": "message"}  # fmt: skip
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": response},
            {"type": "response.in_progress", "response": response},
            {"type": "response.output_item.added", "item": item, "output_index": 0},
            {"type": "response.content_part.added", "content_index": 0, "item_id": "msg_first",
             "output_index": 0, "part": part},
        ]  # fmt: skip
        for piece in ANSWER[: self.opts.die_after]:
            events.append({"type": "response.output_text.delta", "content_index": 0,
                           "delta": piece, "item_id": "msg_first", "logprobs": [],
                           "output_index": 0})  # fmt: skip
        for seq, obj in enumerate(events):
            self._anthropic({**obj, "sequence_number": seq})  # the same event: and data: framing
        os._exit(1)  # mid-body: the gateway reads a connection that broke

    def _whole_response(self, body: dict[str, Any]) -> None:
        text = "".join(ANSWER)
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        item = {"id": "msg_whole", "content": [part], "role": "assistant", "status": "completed",
                "type": "message"}  # fmt: skip
        data = json.dumps({"id": body.get("request_id"), "object": "response", "created_at": 1,
                           "model": self.opts.model, "output": [item], "status": "completed",
                           "usage": {"input_tokens": 3, "output_tokens": len(ANSWER),
                                     "total_tokens": 3 + len(ANSWER)}}).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.opts.die_after:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            os._exit(1)  # mid-body
        self.wfile.write(data)

    def _completion(self, body: dict[str, Any]) -> None:
        prompt = body["prompt"]
        ids = [ord(c) for c in prompt] if isinstance(prompt, str) else prompt
        text = "".join(chr(i) for i in ids)
        marker = "<|assistant|>"
        partial = text.rsplit(marker, 1)[1] if marker in text else None
        pieces = ["MISMATCH"] if partial is None or not FULL.startswith(partial) else None
        pieces = pieces or rest_after(partial or "")
        limit = int(body.get("max_tokens", 16))
        dies = isinstance(prompt, str) and not partial  # a new answer: it dies as a chat's does
        self._start_stream()
        head = {"id": "cmpl-first" if dies else "cmpl-second", "object": "text_completion",
                "created": 1 if dies else 2, "model": self.opts.model}  # fmt: skip
        sent = pieces[: self.opts.die_after] if dies else pieces[:limit]
        for i, piece in enumerate(sent):
            last = i == len(sent) - 1 and not dies
            reason = ("stop" if len(sent) == len(pieces) else "length") if last else None
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason,
                      "stop_reason": None}  # fmt: skip
            if not self.opts.no_token_ids:
                asked = body.get("return_token_ids") and i == 0
                choice["prompt_token_ids"] = ids if asked else None
                choice |= self._ids(body, piece)
            self._event({**head, "choices": [choice]})
        if dies:
            os._exit(1)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(sent),
                     "completion_tokens": len(sent)}  # fmt: skip
            self._event({**head, "choices": [], "usage": usage})
        self._event(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--die-after", type=int, default=7)
    p.add_argument("--no-token-ids", action="store_true", help="as a vLLM without them")
    opts = p.parse_args()
    _Handler.opts = opts
    ThreadingHTTPServer(("127.0.0.1", opts.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
