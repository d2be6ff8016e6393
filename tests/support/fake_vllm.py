"""A tiny stand-in for ``vllm serve``, for supervisor tests. Standard library only.

Takes vLLM's flags (``--host --port --served-model-name --max-model-len``; unknown flags and
the positional model are ignored) plus test knobs:

    --startup-delay S    sleep before listening (vLLM refuses connections while loading)
    --crash-after-s S    print an engine-error traceback and exit S seconds after listening
                         (0: before listening)
    --exit-code N        exit status of that crash (default 1)
    --ignore-sigterm     ignore SIGTERM (server and child), to exercise SIGKILL escalation
    --record FILE        append each chat completion body as one JSON line
    --info-file FILE     write {"pid", "child", "argv", "env"} once the child is running

Like vLLM, it forks a child (its "EngineCore") that does not exit when its parent dies, so only
killing the whole process group cleans up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_ENV_SHOWN = ("CUDA_VISIBLE_DEVICES", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "GPUPOOL_WORKER_TOKEN")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="fake")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--crash-after-s", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--record", default=None)
    p.add_argument("--info-file", default=None)
    p.add_argument("--engine-core", action="store_true", help=argparse.SUPPRESS)
    args, _unknown = p.parse_known_args(argv)
    return args


def _engine_core() -> None:
    while True:
        time.sleep(3600)


def _crash(code: int) -> None:
    print("ERROR EngineCore encountered a fatal error.", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print("RuntimeError: Triton Error [CUDA]: out of memory", flush=True)
    os._exit(code)


def _write_info(path: str, child: subprocess.Popen[bytes]) -> None:
    info = {
        "pid": os.getpid(),
        "child": child.pid,
        "argv": sys.argv[1:],
        "env": {k: os.environ.get(k) for k in _ENV_SHOWN},
    }
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(info, f)
    os.replace(tmp, path)


class _Handler(BaseHTTPRequestHandler):
    server_version = "fake-vllm"
    opts: argparse.Namespace
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        print(f"INFO {self.address_string()} {format % args}", flush=True)

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/models":
            card = {
                "id": self.opts.served_model_name,
                "object": "model",
                "owned_by": "vllm",
                "root": "fake",
                "max_model_len": self.opts.max_model_len,
            }
            self._json(200, {"object": "list", "data": [card]})
        else:
            self._json(404, {"error": {"message": "Not Found", "code": 404}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": "Not Found", "code": 404}})
            return
        if self.opts.record:
            with self.lock, open(self.opts.record, "a", encoding="utf-8") as f:
                f.write(json.dumps(body) + "\n")
        self._json(200, _completion(self.opts.served_model_name))


def _completion(model: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def main(argv: list[str]) -> None:
    opts = _parse(argv)
    if opts.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child too
    if opts.engine_core:
        _engine_core()
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine-core", *argv])
    if opts.info_file:
        _write_info(opts.info_file, child)
    print(f"INFO fake vllm starting (pid {os.getpid()}, engine core {child.pid})", flush=True)
    time.sleep(opts.startup_delay)
    if opts.crash_after_s == 0:
        _crash(opts.exit_code)
    _Handler.opts = opts
    server = ThreadingHTTPServer((opts.host, opts.port), _Handler)
    server.daemon_threads = True
    print(f"INFO Starting vLLM server on http://{opts.host}:{opts.port}", flush=True)
    if opts.crash_after_s:
        threading.Timer(opts.crash_after_s, _crash, (opts.exit_code,)).start()
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
