"""Server-sent-event framing for the slow path (a response that must be transformed).

vLLM writes ``data: <json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` at the end and, with
``--sse-keep-alive-interval``, ``: keep-alive\\n\\n`` comments. :func:`iter_events` turns a byte
stream into those payloads; comment lines come back as they are (starting with ``b":"``) so the
caller can forward them with :func:`frame_comment`. Responses that need no transform never come
through here: their bytes pass untouched.
"""

from __future__ import annotations

import orjson

DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"


def iter_events(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data`` to ``buffer``; return every complete event, leaving the tail in ``buffer``.

    Each item is either a ``data`` payload (several ``data:`` lines joined by ``\\n``) or a
    comment line such as ``b": keep-alive"``; tell them apart with :func:`is_comment`. Other
    fields (``event:``, ``id:``, ``retry:``) are ignored. CRLF and CR line ends are accepted.
    """
    buffer += data
    if b"\r" in buffer:
        _normalise_line_ends(buffer)
    out: list[bytes] = []
    start = 0
    while (end := buffer.find(b"\n\n", start)) != -1:
        _parse_block(bytes(buffer[start:end]), out)
        start = end + 2
    del buffer[:start]
    return out


def is_comment(item: bytes) -> bool:
    return item.startswith(b":")


def frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def frame_comment(line: bytes) -> bytes:
    """A comment item from :func:`iter_events`, framed again for the client."""
    return line + b"\n\n"


def _normalise_line_ends(buffer: bytearray) -> None:
    # A trailing CR may be the first half of a CRLF split across reads: keep it for later.
    tail = b"\r" if buffer.endswith(b"\r") else b""
    body = bytes(buffer[: len(buffer) - len(tail)])
    buffer[:] = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + tail


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
