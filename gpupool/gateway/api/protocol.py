"""uvicorn's httptools protocol with the limits a public server needs.

- The request head (request line and headers) must arrive within ``head_timeout_s`` of the
  connection opening or of the previous response, or the connection is closed (slowloris).
- The request head may not exceed ``max_head_bytes``; beyond it: 431 and close.
Bodies are bounded by size and time in the application (``read_body``).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized head."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    head_timeout_s = 10.0
    max_head_bytes = 64 * 1024
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if self._head_bytes > self.max_head_bytes:  # our callback stopped the parser
            self._send_431()
        else:
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._arm()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            raise HeadTooLarge

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def _send_431(self) -> None:
        body = (
            b'{"error":{"message":"Request header fields too large.",'
            b'"type":"BadRequestError","param":null,"code":431}}'
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()


def guarded_protocol(head_timeout_s: float, max_head_bytes: int) -> type[HttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, with these limits."""
    limits = {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), limits)
