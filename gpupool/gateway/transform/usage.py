"""A stream's usage chunk the gateway asked for, taken out again so the client sees vLLM's bytes.

The gateway asks the worker for ``stream_options.include_usage`` on every chat and completions
stream, so every token is counted (``gpupool_tokens_total``, key budgets) even when the client
did not ask. What vLLM (0.32, ``chat_completion/serving.py``, ``completion/serving.py``) writes
differs in two places with and without the option:

    without:  … {…"choices":[{…"finish_reason":"stop"…}],"system_fingerprint":"F"}  [DONE]
    with:     … {…"choices":[{…"finish_reason":"stop"…}]}  {…"choices":[],"usage":{…},
                                                             "system_fingerprint":"F"}  [DONE]

so :class:`UsageStrip` drops the usage chunk and puts its fingerprint back on each finishing
chunk. The fingerprint is only known from the usage chunk, which vLLM sends right after the
last choice finishes: a finishing chunk, and whatever follows it, is held until then. With
several choices (``n`` > 1, or several prompts) only the finishing chunks are held
(``interleaved``): the other choices' chunks go on as they come, so a choice that finishes
early does not stall the rest; each choice's own chunks keep their order, and a finishing
chunk reaches the client when the last choice finishes (docs: Differences from vLLM).
What is held is bounded by ``max_held`` bytes; past it, the held events go out as they came
(without the fingerprint) rather than the stream stalling or failing.

Events pass as the bytes the worker wrote (``data: <payload>\\n\\n``): a payload is only parsed
when it may be a finishing or usage chunk (a JSON string cannot hold an unescaped ``"``, so the
byte patterns below cannot match inside a text).
"""

from __future__ import annotations

import orjson

_FINISHING = b'"finish_reason":"'  # a choice that ends in this chunk (else it is null)
_USAGE = b'"usage":{'
_NO_CHOICES = b'"choices":[]'
_FINGERPRINT = b'"system_fingerprint"'
_DONE = b"[DONE]"


class UsageStrip:
    """Feed each event payload of a chat or completions stream (``EventBuffer.events``); get
    back the bytes the client should see now. Call :meth:`end` when the stream ends."""

    __slots__ = ("_held", "_held_bytes", "_interleaved", "_max_held")

    def __init__(self, max_held: int, interleaved: bool = False) -> None:
        self._held: list[tuple[bytes, bool]] = []  # (payload, finishing) since the first finish
        self._held_bytes = 0
        self._max_held = max_held
        self._interleaved = interleaved  # several choices: hold finishing chunks only

    def passes(self, chunk: bytes) -> bool:
        """Whether ``chunk`` (whole events, nothing held before it) goes out as it is: no
        choice finishes and no usage comes in it, so nothing in it is held or dropped. Most
        reads are one token's event: they skip the event split."""
        return (
            (not self._held or self._interleaved)
            and chunk.endswith(b"\n\n")
            and _FINISHING not in chunk
            and b'"usage"' not in chunk
            and b"\r" not in chunk
        )

    def event(self, payload: bytes) -> bytes:
        """The bytes to send for ``payload`` (a JSON payload, ``[DONE]`` or a comment line)."""
        if payload.startswith(b":"):
            return self._after_held(payload, payload + b"\n\n")
        if payload == _DONE:
            return self.end() + b"data: [DONE]\n\n"
        if _USAGE in payload and _NO_CHOICES in payload:
            usage, fingerprint = _usage_chunk(payload)
            if usage:
                return self._release(fingerprint)
        finishing = _FINISHING in payload
        if finishing or (self._held and not self._interleaved):
            self._held.append((payload, finishing))
            self._held_bytes += len(payload)
            if self._held_bytes > self._max_held:
                return self.end()
            return b""
        return b"data: " + payload + b"\n\n"

    def end(self) -> bytes:
        """What is held, as it came: the stream ended (or grew past the bound) without a
        usage chunk to take the fingerprint from."""
        return self._release(None)

    def _after_held(self, payload: bytes, framed: bytes) -> bytes:
        if not self._held or self._interleaved:
            return framed
        self._held.append((payload, False))
        self._held_bytes += len(payload)
        return b""

    def _release(self, fingerprint: str | None) -> bytes:
        out = bytearray()
        stamp = b',"system_fingerprint":' + orjson.dumps(fingerprint) + b"}"
        for payload, finishing in self._held:
            if payload.startswith(b":"):
                out += payload + b"\n\n"
                continue
            if finishing and fingerprint is not None and _FINGERPRINT not in payload:
                payload = payload.rstrip()
                if payload.endswith(b"}"):
                    payload = payload[:-1] + stamp
            out += b"data: " + payload + b"\n\n"
        self._held.clear()
        self._held_bytes = 0
        return bytes(out)


def _usage_chunk(payload: bytes) -> tuple[bool, str | None]:
    """Whether ``payload`` is a usage chunk (no choices), and its ``system_fingerprint``."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False, None
    if not isinstance(obj, dict) or obj.get("choices") != [] or "usage" not in obj:
        return False, None
    fingerprint = obj.get("system_fingerprint")
    return True, fingerprint if isinstance(fingerprint, str) else None


def plain(payload: bytes) -> bytes:
    """An event payload (or comment line) framed again as vLLM frames it."""
    return payload + b"\n\n" if payload.startswith(b":") else b"data: " + payload + b"\n\n"
