"""Writing a :class:`Reply` through ASGI: one function for the front door and Starlette routes.

A stream is written chunk by chunk; whoever calls :func:`write_reply` for a stream watches for
the client's disconnect (the front door does, ``front.py``), so the relay is cancelled at once
and the worker connection dropped.
"""

from __future__ import annotations

import contextlib

from starlette.types import Receive, Scope, Send

from gpupool.gateway.reply import Reply


def raw_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]


async def write_reply(reply: Reply, send: Send, extra: list[tuple[bytes, bytes]]) -> None:
    """Send ``reply`` with ``extra`` headers: a sized body, or a stream until it ends."""
    headers = raw_headers(reply.headers)
    headers += extra
    if reply.stream is None:
        headers.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body})
        return
    stream = reply.stream
    try:
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:
        pass  # the client went away while we wrote
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


class ReplyResponse:
    """A whole :class:`Reply` as a Starlette response (health, metrics, models, admin)."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await write_reply(self.reply, send, [])
