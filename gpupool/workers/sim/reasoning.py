"""vLLM's ``--reasoning-parser qwen3`` split of ``<think>…</think>`` output.

With thinking on, the parser starts in the reasoning state: everything up to ``</think>`` is
reasoning and a leading ``<think>`` is swallowed; without ``</think>`` everything is reasoning.
With ``enable_thinking: false`` everything is content. A second ``</think>`` is dropped.
Streaming holds back partial tags (pieces may split them anywhere) and whitespace-only content,
which is prepended to the next content; :meth:`Qwen3Splitter.flush` releases what is held.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
_CHATML_START = "<|im_start|>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_ends_reasoning(prompt: str) -> bool:
    """True when the prompt already closed the reasoning (a ``</think>`` after the last turn
    start), as vLLM's streaming wrapper checks the prompt before parsing the output."""
    end = prompt.rfind(THINK_END)
    return end >= 0 and end > prompt.rfind(THINK_START) and end > prompt.rfind(_CHATML_START)


class Qwen3Splitter:
    """Feeds output pieces, returns ``(reasoning, content)`` deltas."""

    __slots__ = ("_at_start", "_buf", "_held_ws", "in_reasoning")

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self._at_start = thinking
        self._buf = ""
        self._held_ws = ""

    def feed(self, piece: str) -> tuple[str, str]:
        buf = self._buf + piece
        self._buf = ""
        reasoning = ""
        if self.in_reasoning:
            if self._at_start:
                if len(buf) < len(THINK_START) and THINK_START.startswith(buf):
                    self._buf = buf
                    return "", ""
                if buf.startswith(THINK_START):
                    buf = buf[len(THINK_START) :]
                self._at_start = False
            end = buf.find(THINK_END)
            if end < 0:
                keep = _partial_suffix(buf, THINK_END)
                self._buf = buf[len(buf) - keep :] if keep else ""
                return buf[: len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(THINK_END) :]
            self.in_reasoning = False
        return reasoning, self._content(buf)

    def _content(self, buf: str) -> str:
        buf = buf.replace(THINK_END, "")
        keep = _partial_suffix(buf, THINK_END)
        if keep:
            self._buf = buf[len(buf) - keep :]
            buf = buf[: len(buf) - keep]
        if not buf:
            return ""
        if buf.isspace():
            self._held_ws += buf
            return ""
        out = self._held_ws + buf
        self._held_ws = ""
        return out

    def flush(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        buf, self._buf = self._buf, ""
        if self.in_reasoning:
            return buf, ""
        out = self._held_ws + buf
        self._held_ws = ""
        return "", out


def split_all(pieces: list[str], thinking: bool) -> tuple[str | None, str | None, int]:
    """The non-streaming split: ``(reasoning or None, content or None, reasoning_tokens)``."""
    splitter = Qwen3Splitter(thinking)
    reasoning: list[str] = []
    content: list[str] = []
    reasoning_tokens = 0
    for piece in pieces:
        reasoning_tokens += splitter.in_reasoning
        r, c = splitter.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.flush()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning) or None, "".join(content) or None, reasoning_tokens
