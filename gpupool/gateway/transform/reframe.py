"""What every continued stream shares (request migration): reading what went out, and
re-framing a completion's chunks into the events a client is reading.

* :class:`StreamProgress` reads a stream's events as they go to the client and holds back the
  end of an event not yet complete (a client never holds half an event that a continuation
  could not end). Each route reads its own events (:meth:`StreamProgress.note`): chat and
  completions chunks (``continuation.Progress``), Anthropic events (``messages_continuation``),
  Responses events (``responses_continuation``).
* :class:`AsEvents` turns the chunks of the ``/v1/completions`` that continues an answer (a
  completion of vLLM's own rendering: ``pipeline/continue_completion.py``) into the client's
  route's events; each route frames a text, the end and an error (``_text``, ``_end``,
  ``_error``).
* :class:`Route` is what a route whose answers go on as such a completion supplies to the
  pipeline's migrating loop (``pipeline/continue_events.py``): its progress, why an answer
  cannot be continued, the chat messages vLLM renders, the completion's body, the re-framer and
  the end of an answer with nothing left to generate.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import orjson

from gpupool.gateway.transform.sse import EventBuffer

Json = dict[str, Any]


def events_end(data: bytes) -> int:
    """Where the last whole event of ``data`` ends (0: none ends in it)."""
    end = 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.rfind(sep)
        if at >= 0:
            end = max(end, at + len(sep))
    return end


class Rewriter(Protocol):
    """A stream's reader on its way to the client: whole events out, an unended one held."""

    def rewrite(self, chunk: bytes) -> bytes: ...

    def pending(self) -> int: ...


class StreamProgress:
    """What a stream has given its client so far: the text (``parts``), how many token events
    carried it, whether an event went out (``begun``), the end (``finished``), and what makes
    the rest impossible to continue exactly (``broken``). ``origin``: the request as its first
    worker got it, once a move needed it. Subclasses read their route's events (``note``)."""

    __slots__ = ("_buf", "_hold", "begun", "broken", "done", "finished", "origin", "parts",
                 "tokens")  # fmt: skip

    def __init__(self) -> None:
        self._buf = EventBuffer()
        self._hold = b""
        self.parts: list[str] = []
        self.tokens = 0
        self.begun = False  # an event went out: a restart would repeat it
        self.broken: str | None = None
        self.finished = False
        self.done = False  # a chat or completions stream's ``data: [DONE]`` went out
        self.origin: Json | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def pending(self) -> int:
        """Bytes of an event not ended yet, held back (the caller bounds them)."""
        return len(self._hold)

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of what came so far, read; the end of an unended one held back."""
        data = self._hold + chunk if self._hold else chunk
        end = events_end(data)
        if not end:
            self._hold = data
            return b""
        self._hold, data = data[end:], data[:end]
        for payload in self._payloads(data):
            if not payload.startswith(b"{"):
                self.done = self.done or payload == b"[DONE]"
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                self.note(obj)
        return data

    rewrite = feed  # the first worker's events go out as they came

    def rest(self) -> bytes:
        """What is held back when the stream ends (an unended last event passes as it came)."""
        rest, self._hold = self._hold, b""
        return rest

    def _payloads(self, data: bytes) -> list[bytes]:
        """The data of whole events: vLLM's framing (an optional ``event:`` line, then one
        ``data: `` line; LF ends) read directly, anything else through the general parser."""
        if b"\r" in data:
            return self._buf.events(data)
        out = []
        for block in data.split(b"\n\n"):
            if block.startswith(b"data: ") and b"\n" not in block:
                out.append(block[6:])  # chat and completions: the common read
                continue
            at = -1 if block.startswith(b"data") else block.find(b"\ndata: ")
            if at >= 0 and block.find(b"\n", at + 1) < 0:
                out.append(block[at + 7 :])
            elif block:
                out += self._buf.events(block + b"\n\n")
        return out

    def note(self, obj: Json) -> None:
        """One event's object as it goes to the client."""
        raise NotImplementedError


class AsEvents:
    """A completion's chunks re-framed into the client's stream (module docstring); feeds
    ``progress`` so a further move continues from here. ``prompt``: the rendered prompt's
    tokens (the new worker's ``/tokenize``), the usage's input."""

    __slots__ = ("_buf", "_failed", "_finish", "before", "progress", "prompt", "usage")

    def __init__(self, progress: StreamProgress, prompt: int) -> None:
        self.progress = progress
        self.before = progress.tokens  # tokens the client had before this worker
        self.prompt = prompt
        self.usage: Json | None = None  # the completion's own usage, once it came
        self._buf = EventBuffer()
        self._finish: tuple[object, object] = (None, None)  # (finish_reason, stop_reason)
        self._failed = False  # the worker sent its in-stream error: passed on, nothing after

    def pending(self) -> int:
        return len(self._buf)

    def rewrite(self, chunk: bytes) -> bytes:
        out = bytearray()
        for payload in self._buf.events(chunk):
            if payload.startswith(b":"):
                out += payload + b"\n\n"
            elif payload == b"[DONE]":
                out += b"" if self._failed else self._end(self.progress.tokens)
            elif payload.startswith(b"{"):
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    out += self._one(obj)
        return bytes(out)

    def _one(self, obj: Json) -> bytes:
        if "error" in obj and not obj.get("choices"):  # vLLM's in-stream error chunk
            self._failed = True
            error = obj["error"] if isinstance(obj["error"], dict) else {}
            return self._error(str(error.get("message") or "The worker failed mid-answer."))
        out = b""
        for c in obj.get("choices") or []:
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            text = c.get("text")
            if isinstance(text, str) and text:
                out += self._text(text)
            if c.get("finish_reason") is not None:
                self._finish = (c["finish_reason"], c.get("stop_reason"))
        usage = obj.get("usage")
        if isinstance(usage, dict) and not obj.get("choices"):
            self.usage = usage
            made = usage.get("completion_tokens")
            total = self.before + made if isinstance(made, int) else self.progress.tokens
            out += self._end(total)
        return out

    def _text(self, text: str) -> bytes:
        """The events carrying one token's ``text`` (the progress noted)."""
        raise NotImplementedError

    def _end(self, output_tokens: int) -> bytes:
        """The events that end the answer (whichever did not go out yet), ``output_tokens``
        long; ``self._finish``: the completion's finish and stop reasons."""
        raise NotImplementedError

    def _error(self, message: str) -> bytes:
        """The route's error event."""
        raise NotImplementedError


P = TypeVar("P", bound=StreamProgress)


class Route(Protocol[P]):
    """What a route whose streams go on as a completion of vLLM's rendering supplies."""

    label: str  # for the log line: "a /v1/messages answer"

    def progress(self) -> P:
        """A new stream's progress."""
        ...

    def refusal(self, origin: Json, progress: P) -> str | None:
        """Why an answer that began cannot be continued exactly (the ``refused`` reason)."""
        ...

    def end(self, origin: Json, progress: P) -> bytes | None:
        """The answer's end by the gateway when no token is left to generate; else None."""
        ...

    def render(self, origin: Json) -> Json:
        """The chat-form ``/tokenize`` fields (``messages``, kwargs) vLLM renders it from."""
        ...

    def body(self, origin: Json, ids: list[int], sent: int, room: int) -> Json | None:
        """The completion that goes on from ``ids`` after ``sent`` tokens (None: no room)."""
        ...

    def reframer(self, progress: P, prompt: int) -> Rewriter:
        """The completion's chunks as the client's events."""
        ...
