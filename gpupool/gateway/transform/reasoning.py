"""Reasoning parsers: split raw model output into (reasoning, content).

Used when a worker runs without ``--reasoning-parser`` and returns ``<think>…</think>`` in
``content``. Each parser is a small class over one shared tag state machine, registered by name
(as vLLM's ``reasoning/abs_reasoning_parsers.py`` / ``basic_parsers.py``)::

    parser = get_parser("qwen3")(start_in_reasoning=True)   # one instance per choice
    parser.feed("<think>Let me th")   -> ("Let me th", "")
    parser.feed("ink</think>\\n\\nHi") -> ("ink", "\\n\\nHi")
    parser.finish()                   -> ("", "")
    parser.split("<think>a</think>b") -> ("a", "b")          # fresh state, non-streaming

Streaming and non-streaming share the machine, so the concatenated stream always equals the
non-streaming split. A tag cut across chunks (``<th`` + ``ink>``) is held back until it is
known to be a tag or plain text; nothing else is held, so chunks leave as they came (vLLM's
serving path streams whitespace-only content token by token too). Output cut inside a tag
(``<thin`` at the end) is plain text of the phase it was in, as vLLM's parser flushes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"


class Phase(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL = "tool"  # inside <tool_call>…</tool_call>: content, but </think> is literal text


@dataclass(frozen=True, slots=True)
class Move:
    """What a tag does in a phase: the next phase, and whether the tag text stays (as content)."""

    to: Phase
    keep: bool = False


@dataclass(slots=True)
class _Out:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def pair(self) -> tuple[str, str]:
        return "".join(self.reasoning), "".join(self.content)


class ReasoningParser:
    """The shared ``<think>`` machine. Subclasses declare a name, a transition table and flags.

    ``transitions`` maps (phase, tag) to a :class:`Move`; a tag not listed for a phase is plain
    text there.
    """

    name: ClassVar[str] = ""
    transitions: ClassVar[Mapping[tuple[Phase, str], Move]] = {}
    uses_enable_thinking: ClassVar[bool] = False  # False: always starts in REASONING
    _tags: ClassVar[dict[Phase, tuple[str, ...]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._tags = {p: tuple(t for (q, t) in cls.transitions if q is p) for p in Phase}

    def __init__(self, *, start_in_reasoning: bool = True) -> None:
        self._start_in_reasoning = start_in_reasoning
        start = start_in_reasoning or not self.uses_enable_thinking
        self._phase = Phase.REASONING if start else Phase.CONTENT
        self._buf = ""

    @property
    def phase(self) -> Phase:
        return self._phase

    def feed(self, text: str) -> tuple[str, str]:
        """Consume one delta; return the (reasoning, content) text that is now certain."""
        out = _Out()
        self._buf += text
        self._drain(out, final=False)
        return out.pair()

    def finish(self) -> tuple[str, str]:
        """End of output: release held-back text (a partial tag is plain text after all)."""
        out = _Out()
        self._drain(out, final=True)
        return out.pair()

    def split(self, text: str) -> tuple[str | None, str | None]:
        """Non-streaming: the whole output at once, on a fresh state; empty parts are None."""
        fresh = type(self)(start_in_reasoning=self._start_in_reasoning)
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def _drain(self, out: _Out, *, final: bool) -> None:
        while True:
            tags = self._tags[self._phase]
            pos, tag = _earliest(self._buf, tags)
            if tag is None:
                break
            self._emit(self._buf[:pos], out)
            self._buf = self._buf[pos + len(tag) :]
            move = self.transitions[(self._phase, tag)]
            self._phase = move.to
            if move.keep:
                self._emit(tag, out)
        hold = 0 if final else _partial_tag_len(self._buf, self._tags[self._phase])
        cut = len(self._buf) - hold
        self._emit(self._buf[:cut], out)
        self._buf = self._buf[cut:]

    def _emit(self, text: str, out: _Out) -> None:
        if not text:
            return
        (out.reasoning if self._phase is Phase.REASONING else out.content).append(text)


def _earliest(buf: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(buf), None
    for tag in tags:
        pos = buf.find(tag, 0, best + len(tag))
        if pos != -1 and pos < best:
            best, found = pos, tag
    return best, found


def _partial_tag_len(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    if not tags:
        return 0
    longest = max(len(t) for t in tags) - 1
    for k in range(min(longest, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(t.startswith(tail) for t in tags):
            return k
    return 0


class Qwen3Parser(ReasoningParser):
    """vLLM 0.32 ``qwen3``: starts in REASONING unless ``enable_thinking`` is false.

    ``<think>`` in reasoning is swallowed; ``</think>`` ends it and is dropped again later;
    ``<tool_call>`` ends reasoning implicitly and stays in content for the tool parser; inside
    a tool call ``</think>`` is ordinary text.
    """

    name = "qwen3"
    uses_enable_thinking = True
    transitions = {
        (Phase.REASONING, THINK_START): Move(Phase.REASONING),
        (Phase.REASONING, THINK_END): Move(Phase.CONTENT),
        (Phase.REASONING, TOOL_START): Move(Phase.TOOL, keep=True),
        (Phase.CONTENT, THINK_END): Move(Phase.CONTENT),
        (Phase.CONTENT, TOOL_START): Move(Phase.TOOL, keep=True),
        (Phase.TOOL, TOOL_END): Move(Phase.CONTENT, keep=True),
    }


class DeepSeekR1Parser(ReasoningParser):
    """vLLM ``deepseek_r1``: reasoning until ``</think>``, then content; ignores enable_thinking.

    ``<think>`` inside reasoning is swallowed. After ``</think>`` every tag is plain text.
    """

    name = "deepseek_r1"
    transitions = {
        (Phase.REASONING, THINK_START): Move(Phase.REASONING),
        (Phase.REASONING, THINK_END): Move(Phase.CONTENT),
    }


_PARSERS: Mapping[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3Parser, DeepSeekR1Parser)
}


def known_parsers() -> list[str]:
    return sorted(_PARSERS)


def get_parser(name: str) -> type[ReasoningParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser `{name}` (known: {', '.join(known_parsers())})"
        ) from None
