"""A fake vLLM that writes scripted stream bytes (adversarial migration tests).

Every generation request is answered with the script's events, written as they are (raw
bytes, one chunked write each, so a test chooses the framing, the ids and any lie):

* a new answer (``/v1/chat/completions``, ``/v1/responses``, or ``/v1/completions`` whose
  prompt is text) gets the script's events for its route (``chat``, ``responses`` or
  ``completions``; ``chat_ids`` instead, where given, for a request that asks for
  ``return_token_ids``), then the worker exits mid-body (as ``kill -9``);
* a continuation (``/v1/completions`` whose prompt is token ids, or a chat with
  ``continue_final_message``) gets the script's ``rest`` events, then a clean end.

``/tokenize`` answers one token a character (the JSON of ``messages``, or ``prompt``), and
``GET /stats`` gives every request it took. Run it as a process::

    python -m tests.support.script_worker --port 8123 --model m --script script.json

where ``script.json`` is ``{"chat": [...], "responses": [...], "rest": [...]}`` (each a list
of strings, every one written as one chunk; ``"SLEEP"`` stays silent for 30 s instead,
``"END"`` ends the answer cleanly there).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    opts: argparse.Namespace
    script: dict[str, list[str]] = {}
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
            card = {"id": self.opts.model, "object": "model", "max_model_len": 4096}
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
        if self.path == "/tokenize":  # one token a character, its code point
            text = json.dumps(body.get("messages")) + str(body.get("prompt") or "")
            self._json(200, {"tokens": [ord(c) for c in text], "max_model_len": 4096})
            return
        prompt = body.get("prompt")
        going_on = isinstance(prompt, list) or bool(body.get("continue_final_message"))
        route = _ROUTES.get(self.path, "completions")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if body.get("return_token_ids") and route + "_ids" in self.script:
            route += "_ids"  # what it writes when asked for the ids
        for part in self.script["rest" if going_on else route]:
            if part == "SLEEP":  # a worker that goes silent (the client may leave meanwhile)
                time.sleep(30)
                continue
            if part == "END":  # the answer is whole: a clean end, no death
                going_on = True
                break
            data = part.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        if not going_on:
            os._exit(1)  # mid-body: the gateway reads a connection that broke
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--script", required=True)
    opts = p.parse_args()
    _Handler.opts = opts
    with open(opts.script) as f:
        _Handler.script = json.load(f)
    ThreadingHTTPServer(("127.0.0.1", opts.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
