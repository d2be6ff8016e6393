"""Server-sent-event framing for the slow path (a response that must be transformed).

vLLM writes ``data: <json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` at the end and, with
``--sse-keep-alive-interval``, ``: keep-alive\\n\\n`` comments. An :class:`EventBuffer` turns a
byte stream into those payloads (:meth:`EventBuffer.events`) or into raw blocks
(:meth:`EventBuffer.blocks`, for ``event:``/``data:`` streams); comment lines come back as they
are (starting with ``b":"``) so the caller can forward them with :func:`frame_comment`.
Responses that need no transform never come through here: their bytes pass untouched.

A worker may send one event in many reads. The buffer searches each byte for the blank line
that ends an event once, remembering how far it searched: an event of N bytes in K reads costs
N, not N times K (the caller bounds N with ``max_event_bytes``).
"""

from __future__ import annotations

import orjson

DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"


class EventBuffer:
    """The unended tail of an SSE stream; ``blocks``/``events`` add a read and return what it
    completed. ``crlf``: CR and CRLF line ends are read as LF (the payload API's promise)."""

    __slots__ = ("_cr", "_crlf", "_searched", "_tail", "scanned")

    def __init__(self, *, crlf: bool = True) -> None:
        self._tail = bytearray()
        self._searched = 0  # bytes of ``_tail`` already searched for a blank line
        self._crlf = crlf
        self._cr = b""  # a CR held back: maybe the first half of a CRLF split across reads
        self.scanned = 0  # bytes searched so far, all reads together (linear in the stream)

    def __len__(self) -> int:
        return len(self._tail) + len(self._cr)

    def tail(self) -> bytes:
        """What is buffered: the start of an event not ended yet."""
        return bytes(self._tail) + self._cr

    def blocks(self, data: bytes) -> list[bytes]:
        """Append ``data``; every block (the lines between blank lines) it completed."""
        tail = self._tail
        tail += self._lf(data) if self._crlf else data
        # resume one byte back: the blank line may have begun with the last byte searched
        pos = max(0, self._searched - 1)
        self.scanned += len(tail) - pos
        out: list[bytes] = []
        start = 0
        while (end := tail.find(b"\n\n", pos)) != -1:
            out.append(bytes(tail[start:end]))
            start = pos = end + 2
        if start:
            del tail[:start]  # what is left came in this read: moving it is linear too
        self._searched = len(tail)
        return out

    def events(self, data: bytes) -> list[bytes]:
        """Append ``data``; every event it completed: a ``data`` payload (several ``data:``
        lines joined by ``\\n``) or a comment line such as ``b": keep-alive"`` (tell them apart
        with :func:`is_comment`). Other fields (``event:``, ``id:``, ``retry:``) are ignored."""
        out: list[bytes] = []
        for block in self.blocks(data):
            _parse_block(block, out)
        return out

    def _lf(self, data: bytes) -> bytes:
        """``data`` with CR and CRLF line ends made LF (only the new bytes are looked at)."""
        if self._cr:
            data, self._cr = self._cr + data, b""
        if b"\r" not in data:
            return data
        if data.endswith(b"\r"):
            data, self._cr = data[:-1], b"\r"
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def is_comment(item: bytes) -> bool:
    return item.startswith(b":")


def frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def frame_comment(line: bytes) -> bytes:
    """A comment item from :meth:`EventBuffer.events`, framed again for the client."""
    return line + b"\n\n"


def _parse_block(block: bytes, out: list[bytes]) -> None:
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b":"):
            out.append(line)
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    if data:
        out.append(b"\n".join(data))
