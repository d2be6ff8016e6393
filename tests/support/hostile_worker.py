"""A raw-socket fake vLLM that stays ready and misbehaves on generation (issue 26).

``/health``, ``/v1/models`` and ``/metrics`` answer as vLLM's do, so the gateway keeps routing
to it; a generation request (``/v1/completions`` or ``/v1/chat/completions``) is answered the
way its *mode* says: the completion's ``prompt``, or the chat's last message. Every mode writes
bytes by hand (asyncio streams, no HTTP library), so it can break HTTP in ways no server
framework would. Run it as a process::

    python -m tests.support.hostile_worker --port 8123 --model m --window 4096

Connections are kept alive like uvicorn's; ``GET /stats`` tells how many generation requests
arrived per mode and how many connections the gateway opened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

Writer = asyncio.StreamWriter
MiB = 1 << 20
FOREVER_S = 60.0  # how long an endless mode keeps going if the gateway does not hang up
HOSTILE_HEADERS = [
    ("set-cookie", "session=stolen; Path=/"),
    ("x-gpupool-worker", "not-the-worker"),
    ("x-gpupool-queue-ms", "0"),
    ("access-control-allow-origin", "*"),
    ("access-control-allow-credentials", "true"),
    ("location", "http://evil.example/"),
    ("www-authenticate", 'Basic realm="worker"'),
    ("proxy-authenticate", "Basic"),
    ("strict-transport-security", "max-age=0"),
    ("alt-svc", 'h3=":443"'),
    ("x-backend-address", "10.1.2.3:8000"),
    ("x-request-id", "worker-chosen-id"),
    ("retry-after", "9999"),
]


class Worker:
    def __init__(self, model: str, window: int) -> None:
        self.model = model
        self.window = window
        self.modes: Counter[str] = Counter()
        self.connections = 0

    # ---- HTTP plumbing ---------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: Writer) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, OSError):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    return
                method, path, length = _head(head)
                body = await reader.readexactly(length) if length else b""
                keep = await self.answer(method, path, body, writer)
                await writer.drain()
                if not keep:
                    return
        with contextlib.suppress(Exception):
            writer.close()

    async def answer(self, method: str, path: str, body: bytes, w: Writer) -> bool:
        """Answer one request; False when the connection must end after it."""
        if method == "GET":
            w.write(_ok(*self.get(path)))
            return True
        req = json.loads(body or b"{}")
        mode = _mode(req)
        self.modes[mode] += 1
        run = MODES.get(mode, ok)
        return await run(self, req, w)

    def get(self, path: str) -> tuple[bytes, str]:
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.window}
            return json.dumps({"object": "list", "data": [card]}).encode(), "application/json"
        if path.startswith("/metrics"):
            label = f'{{model_name="{self.model}"}}'
            text = f"vllm:num_requests_running{label} 0.0\nvllm:num_requests_waiting{label} 0.0\n"
            return text.encode(), "text/plain; version=0.0.4"
        if path == "/stats":
            stats = {"modes": dict(self.modes), "connections": self.connections}
            return json.dumps(stats).encode(), "application/json"
        return b"", "text/plain"

    # ---- what a good worker answers ----------------------------------------------------------

    def completion(self, req: dict[str, Any], **over: Any) -> dict[str, Any]:
        usage = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
        out: dict[str, Any] = {"id": "cmpl-h", "object": "text_completion", "created": 1,
                               "model": req.get("model", self.model), "usage": usage}  # fmt: skip
        if "messages" in req:
            message = {"role": "assistant", "content": "ok"}
            out["object"] = "chat.completion"
            out["choices"] = [{"index": 0, "message": message, "finish_reason": "stop"}]
        else:
            out["choices"] = [{"index": 0, "text": "ok", "finish_reason": "stop"}]
        out.update(over)
        return out

    def chunks(self, req: dict[str, Any], n: int = 3) -> list[bytes]:
        """A stream's events, vLLM's way: ``n`` chunks, a usage chunk if asked, ``[DONE]``."""
        model = req.get("model", self.model)
        chat = "messages" in req
        events = []
        for i in range(n):
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": f"t{i}"}}
            else:
                choice = {"index": 0, "text": f"t{i}"}
            choice["finish_reason"] = "stop" if i == n - 1 else None
            obj = {"id": "s", "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": 1, "model": model, "choices": [choice]}  # fmt: skip
            events.append(_event(obj))
        if (req.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n}
            events.append(_event({"id": "s", "object": "x", "created": 1, "model": model,
                                  "choices": [], "usage": usage}))  # fmt: skip
        return [*events, b"data: [DONE]\n\n"]


# ---- the modes -----------------------------------------------------------------------------

Mode = Callable[[Worker, dict[str, Any], Writer], Awaitable[bool]]


async def ok(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    if req.get("stream"):
        w.write(SSE_HEAD + b"".join(_chunk(e) for e in wk.chunks(req)) + b"0\r\n\r\n")
    else:
        w.write(_ok(json.dumps(wk.completion(req)).encode()))
    return True


async def endless_head(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A status line, then header lines for a minute; never the blank line."""
    w.write(b"HTTP/1.1 200 OK\r\n")
    await _for_a_while(w, lambda i: b"x-h-%d: %s\r\n" % (i, b"v" * 1000), pause_s=0.001)
    return False


async def huge_header(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """One 64 MiB header, then a body."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-big: ")
    for _ in range(64):
        w.write(b"a" * MiB)
        await w.drain()
    w.write(b"\r\ncontent-length: 2\r\n\r\n{}")
    return False


async def many_headers(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """200,000 headers, then a good answer."""
    body = json.dumps(wk.completion(req)).encode()
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    for start in range(0, 200_000, 10_000):
        w.write(b"".join(b"x-%d: v\r\n" % i for i in range(start, start + 10_000)))
        await w.drain()
    w.write(b"content-length: %d\r\n\r\n%b" % (len(body), body))
    return False


async def endless_body(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A non-streamed chunked body, 64 KiB chunks for a minute."""
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
    piece = _chunk(b"x" * 65536)
    await _for_a_while(w, lambda i: piece, pause_s=0.0)
    return False


async def surplus(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """``Content-Length: 20``, then more bytes and a second response, at once."""
    body = b'{"id":"twenty-byte"}'
    assert len(body) == 20
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n"
    w.write(head + body + b"MORE BYTES\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nevil!")
    return True


async def trickle(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good answer, one byte at a time (a tenth of a second apart)."""
    data = _ok(json.dumps(wk.completion(req)).encode())
    for i in range(len(data)):
        w.write(data[i : i + 1])
        await w.drain()
        await asyncio.sleep(0.1)
    return False


async def early_hints(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """``103 Early Hints`` for a minute; never the answer."""
    await _for_a_while(w, lambda i: b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n", 0.01)
    return False


async def huge_usage(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good answer whose usage says 10^30 tokens (written as vLLM writes usage)."""
    body = json.dumps(wk.completion(req), separators=(",", ":")).encode()
    big = b'"usage":{"prompt_tokens":1000000000000000000000000000000,"total_tokens":1,'
    big += b'"completion_tokens":1000000000000000000000000000000}'
    body = (
        body[: body.index(b'"usage":')]
        + big
        + body[body.index(b"}", body.index(b'"usage":')) + 1 :]
    )
    w.write(_ok(body))
    return True


async def float_usage(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """Usage as floats, negatives and strings: none of it is a token count."""
    usage = {"prompt_tokens": 1e30, "completion_tokens": -5, "total_tokens": "many"}
    w.write(_ok(json.dumps(wk.completion(req, usage=usage)).encode()))
    return True


async def spaced_usage(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good answer with its usage written with spaces (``json.dumps``' default)."""
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    w.write(_ok(json.dumps(wk.completion(req, usage=usage), indent=1).encode()))
    return True


async def header_zoo(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good answer with every header a worker must never pass to a client."""
    extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in HOSTILE_HEADERS)
    w.write(_ok(json.dumps(wk.completion(req)).encode(), extra=extra))
    return True


async def gzip_body(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A gzip-encoded answer (the gateway asked for identity)."""
    body = gzip.compress(json.dumps(wk.completion(req)).encode())
    w.write(_ok(body, extra=b"content-encoding: gzip\r\n"))
    return True


async def gzip_stream(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    data = gzip.compress(b"".join(wk.chunks(req)))
    w.write(SSE_HEAD.replace(b"\r\n\r\n", b"\r\ncontent-encoding: gzip\r\n\r\n")
            + _chunk(data) + b"0\r\n\r\n")  # fmt: skip
    return True


async def other_model(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good answer (or stream) from another model than the one asked for (and listed)."""
    if req.get("stream"):
        await ok(wk, {**req, "model": "someone-elses-model"}, w)
    else:
        w.write(_ok(json.dumps(wk.completion(req, model="someone-elses-model")).encode()))
    return True


async def done_mid_json(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A stream whose ``[DONE]`` lands in the middle of a JSON object."""
    first = wk.chunks(req)[0]
    half = first[: len(first) // 2]
    w.write(SSE_HEAD + _chunk(half + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")
    return True


async def split_bytes(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good stream, every byte of it in a chunk of its own."""
    w.write(SSE_HEAD)
    for byte in b"".join(wk.chunks(req)):
        w.write(_chunk(bytes([byte])))
        await w.drain()
    w.write(b"0\r\n\r\n")
    return True


async def no_done(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A stream that ends (cleanly, by HTTP) without ``[DONE]``."""
    w.write(SSE_HEAD + b"".join(_chunk(e) for e in wk.chunks(req)[:-1]) + b"0\r\n\r\n")
    return True


async def silent_stream(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A stream's head and first event, then nothing for a minute."""
    w.write(SSE_HEAD + _chunk(wk.chunks(req)[0]))
    await asyncio.sleep(FOREVER_S)
    return False


async def huge_line(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A stream with one 32 MiB line (no line end), then the rest."""
    w.write(SSE_HEAD + _chunk(b'data: {"x": "'))
    for _ in range(32):
        w.write(_chunk(b"a" * MiB))
        await w.drain()
    w.write(_chunk(b'"}\n\n') + b"".join(_chunk(e) for e in wk.chunks(req)) + b"0\r\n\r\n")
    return False


LONG_TEXT = "a" * (768 * 1024)  # an event under the tests' 1 MiB event bound


async def long_event(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good stream whose first event carries 768 KiB of text, written 1 KiB at a time."""
    first, *rest = wk.chunks(req)
    obj = json.loads(first[len(b"data: ") :])
    choice = obj["choices"][0]
    if "delta" in choice:
        choice["delta"]["content"] = LONG_TEXT
    else:
        choice["text"] = LONG_TEXT
    event = _event(obj)
    w.write(SSE_HEAD)
    for i in range(0, len(event), 1024):
        w.write(_chunk(event[i : i + 1024]))
        await w.drain()
    w.write(b"".join(_chunk(e) for e in rest) + b"0\r\n\r\n")
    return True


async def early_reply(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A good answer, then, on the idle kept-alive connection, a reply to a request not sent
    yet (an answer that would be wrong for whatever comes next)."""
    await ok(wk, req, w)
    await w.drain()
    await asyncio.sleep(0.05)
    evil = json.dumps(wk.completion(req, id="not-yours", model="someone-elses-model")).encode()
    w.write(_ok(evil))
    await w.drain()
    wk.modes["early_reply.sent"] += 1  # /stats: the unasked reply is on the wire
    return True


async def tool_call_dies(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A chat stream's role, text and half a tool call (vLLM's deltas), then the connection
    closed mid-body, as a worker killed mid-answer."""
    return await _dies_after(w, req, [{"content": "Let me look."}, {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": '{"q": "wea'}}]}])  # fmt: skip


async def reasoning_dies(wk: Worker, req: dict[str, Any], w: Writer) -> bool:
    """A chat stream's role and reasoning (vLLM's parser's ``reasoning`` deltas), then the
    connection closed mid-body, as a worker killed mid-thought."""
    return await _dies_after(w, req, [{"reasoning": "First, "}, {"reasoning": "the sky"}])


async def _dies_after(w: Writer, req: dict[str, Any], deltas: list[dict[str, Any]]) -> bool:
    model = req.get("model")
    events = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    events += [{"index": 0, "delta": d, "finish_reason": None} for d in deltas]
    w.write(SSE_HEAD + b"".join(_chunk(_event({"id": "chatcmpl-d", "created": 1, "model": model,
                                                "object": "chat.completion.chunk",
                                                "choices": [c]})) for c in events))  # fmt: skip
    await w.drain()
    await asyncio.sleep(0.1)  # the client has them before the worker dies
    w.close()  # as the kernel closes a killed process's sockets
    return False


MODES: dict[str, Mode] = {f.__name__: f for f in (
    ok, endless_head, huge_header, many_headers, endless_body, surplus, trickle, early_hints,
    huge_usage, float_usage, spaced_usage, header_zoo, gzip_body, gzip_stream, other_model,
    done_mid_json, split_bytes, no_done, silent_stream, huge_line, long_event, early_reply,
    tool_call_dies, reasoning_dies,
)}  # fmt: skip


# ---- bytes ----------------------------------------------------------------------------------

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")  # fmt: skip


def _ok(body: bytes, ctype: str = "application/json", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %b\r\n%bcontent-length: %d\r\n\r\n%b" % (
        ctype.encode(), extra, len(body), body)  # fmt: skip


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _for_a_while(w: Writer, piece: Callable[[int], bytes], pause_s: float) -> None:
    """Write ``piece(i)`` again and again for ``FOREVER_S`` (until the gateway hangs up)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + FOREVER_S
    i = 0
    while loop.time() < end:
        w.write(piece(i))
        await w.drain()
        i += 1
        if pause_s:
            await asyncio.sleep(pause_s)


def _head(head: bytes) -> tuple[str, str, int]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return method, path, length


def _mode(req: dict[str, Any]) -> str:
    if "messages" in req:
        content = req["messages"][-1].get("content")
        return content if isinstance(content, str) else "ok"
    prompt = req.get("prompt")
    return prompt if isinstance(prompt, str) else "ok"


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--window", type=int, default=4096)
    args = p.parse_args()
    worker = Worker(args.model, args.window)
    server = await asyncio.start_server(worker.serve, args.host, args.port, limit=1 << 16)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
