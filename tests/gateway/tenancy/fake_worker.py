"""A worker stand-in that records what it receives (method, path, query, headers, body) and
keeps ``/v1/responses`` responses as vLLM does: in its own memory, under the body's
``request_id``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.support.hostile_tools import serve_in_thread
from tests.support.procs import free_port


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float = 0.0


class FakeWorker:
    def __init__(self, model: str = "m", window: int = 4096) -> None:
        self.model = model
        self.window = window
        self.seen: list[Seen] = []
        self.responses: dict[str, dict[str, Any]] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[Seen]:
        return list(self.seen)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        method, path = scope["method"], scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        body = json.loads(raw) if raw else {}
        if (path.startswith(("/v1/", "/v2/")) and path != "/v1/models") or path == "/tokenize":
            self.seen.append(
                Seen(method, path, scope["query_string"].decode(), headers, body, time.monotonic())
            )
        if method == "GET" and b"stream=true" in scope["query_string"]:
            await self._events(send, path.rsplit("/", 1)[-1])
            return
        status, out = self._answer(method, path, body)
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": data})

    async def _events(self, send: Any, rid: str) -> None:
        """A stored response's events, as vLLM replays a background one (``?stream=true``)."""
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for n, kind in enumerate(("response.created", "response.completed")):
            event = {"type": kind, "sequence_number": n, "response": self.responses[rid]}
            data = b"event: %b\ndata: %b\n\n" % (kind.encode(), json.dumps(event).encode())
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def _answer(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.window}
            return 200, {"object": "list", "data": [card]}
        if path == "/v1/responses" and method == "POST":
            return self._create(body)
        if path.startswith("/v1/responses/"):
            return self._stored(method, path.removeprefix("/v1/responses/"))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        choice = {"index": 0, "text": "ok", "finish_reason": "stop"}
        return 200, {"id": "x", "object": "text_completion", "model": self.model,
                     "choices": [choice], "usage": usage}  # fmt: skip

    def _create(self, body: dict[str, Any]) -> tuple[int, Any]:
        prev = body.get("previous_response_id")
        if prev is not None and prev not in self.responses:
            return _not_found(prev)
        rid = body.get("request_id") or f"resp_{time.monotonic_ns():032x}"
        usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
        resp: dict[str, Any] = {"id": rid, "object": "response", "model": self.model,
                                "status": "completed", "output": [], "usage": usage}  # fmt: skip
        if body.get("store", True):
            self.responses[rid] = resp
        return 200, resp

    def _stored(self, method: str, rest: str) -> tuple[int, Any]:
        rid, _, suffix = rest.partition("/")
        resp = self.responses.get(rid)
        if resp is None:
            return _not_found(rid)
        if method == "DELETE":
            del self.responses[rid]
            return 200, {"id": rid, "object": "response", "deleted": True}
        if suffix == "cancel":
            resp["status"] = "cancelled"
        if suffix == "input_items":
            return 200, {"object": "list", "data": []}
        return 200, resp

    @contextmanager
    def running(self) -> Iterator[FakeWorker]:
        with serve_in_thread(self, self.port):
            yield self


def _not_found(rid: str) -> tuple[int, Any]:
    return 404, {"error": {"message": f"Response with id '{rid}' not found.",
                           "type": "invalid_request_error", "param": "response_id",
                           "code": 404}}  # fmt: skip
