"""ASGI responses for :class:`Reply`: whole bodies, and streams that notice a disconnect.

A stream watches ``receive()`` for ``http.disconnect`` while it waits on the worker, and cancels
the relay at once, so the worker connection is dropped and vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import Message, Receive, Scope, Send

from gpupool.gateway.reply import Reply


def _raw(headers: list[tuple[str, str]], extra: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (*headers, *extra)]


class ReplyResponse:
    def __init__(self, reply: Reply, extra_headers: list[tuple[str, str]] | None = None) -> None:
        self.reply = reply
        self.extra = extra_headers or []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reply = self.reply
        if reply.stream is None:
            headers = _raw(reply.headers, [*self.extra, ("content-length", str(len(reply.body)))])
            await send({"type": "http.response.start", "status": reply.status, "headers": headers})
            await send({"type": "http.response.body", "body": reply.body})
            return
        await send(
            {"type": "http.response.start", "status": reply.status,
             "headers": _raw(reply.headers, self.extra)}
        )  # fmt: skip
        await _pump(reply, receive, send)


async def _watch(receive: Receive, task: asyncio.Task[None], gone: list[bool]) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
            task.cancel()
            return


async def _pump(reply: Reply, receive: Receive, send: Send) -> None:
    assert reply.stream is not None
    task = asyncio.current_task()
    assert task is not None
    gone: list[bool] = []
    watcher = asyncio.ensure_future(_watch(receive, task, gone))
    try:
        async for chunk in reply.stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
    except OSError:
        pass  # the client went away while we wrote
    finally:
        watcher.cancel()
        aclose = getattr(reply.stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
