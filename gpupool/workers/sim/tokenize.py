"""A cheap, deterministic stand-in tokenizer and a ChatML chat template.

Pieces are the special markers, runs of up to four word characters, runs of whitespace, or
single other characters. Every piece holds at least one character, so a text never has more
tokens than UTF-8 bytes: the gateway's ``bytes >= tokens`` upper bound holds here as it does
for byte-level BPE.

A piece's id is the same in every simulator (as a model's vocabulary is the same on every
worker), so one simulator can read the ids another generated (a migrated stream's prompt):
a piece of up to six UTF-8 bytes is its bytes read as a number (after ``_FIRST_ID``), a
word of the lorem text its place in ``WORDS``; only longer pieces (a long run of whitespace)
get an id of this process's own.
"""

from __future__ import annotations

import re
from typing import Any

SPECIAL_IDS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667, "</think>": 151668}
_PIECE = re.compile(r"\w{1,4}|\s+|<(?:\|im_(?:start|end)\||/?think)>|[^\w\s]")
_FIRST_ID = 1000
_SHORT = 6  # bytes: a piece this short is its own id (every id below 2**53: exact in JSON)
_WORD_BASE = 1 << 49
_LOCAL_BASE = 1 << 50
LOREM = (
    "Lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
    "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "Ut",
    "enim", "ad", "minim", "veniam", "quis", "nostrud", "exercitation", "ullamco", "laboris",
    "nisi", "ut", "aliquip", "ex", "ea", "commodo", "consequat",
)  # fmt: skip
WORDS = tuple(dict.fromkeys(w for word in LOREM for w in (word, " " + word)))
_WORD_IDS = {w: _WORD_BASE + i for i, w in enumerate(WORDS)}
_MEDIA_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class UnknownTokenId(ValueError):
    """A token id this tokenizer never handed out."""


class Tokenizer:
    """Splits text into pieces; ids are handed out the first time ``encode`` sees a piece."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = dict(SPECIAL_IDS)
        self._pieces: dict[int, str] = {i: p for p, i in SPECIAL_IDS.items()}

    @staticmethod
    def pieces(text: str) -> list[str]:
        return _PIECE.findall(text)

    @staticmethod
    def count(text: str) -> int:
        return len(_PIECE.findall(text))

    def encode(self, text: str) -> list[int]:
        return [self._id(p) for p in _PIECE.findall(text)]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._piece(i) for i in ids)

    def _piece(self, token_id: int) -> str:
        found = self._pieces.get(token_id)
        if found is not None:
            return found
        if _WORD_BASE <= token_id < _WORD_BASE + len(WORDS):
            return WORDS[token_id - _WORD_BASE]
        if _FIRST_ID <= token_id < _FIRST_ID + (1 << (8 * _SHORT)):
            raw = (token_id - _FIRST_ID).to_bytes(_SHORT, "big").lstrip(b"\0")
            try:
                return raw.decode()
            except UnicodeDecodeError:
                pass
        raise UnknownTokenId(f"Token id {token_id} is out of vocabulary")

    def piece_of(self, token_id: int) -> str:
        return self.decode([token_id])

    def _id(self, piece: str) -> int:
        """The id of one piece: of the tokenizer's, or of the model's output (a lorem word)."""
        found = self._ids.get(piece)
        if found is None:
            raw = piece.encode()
            found = _WORD_IDS.get(piece)
            if found is None and 0 < len(raw) <= _SHORT and raw[0]:
                found = _FIRST_ID + int.from_bytes(raw, "big")
            if found is None:
                found = _LOCAL_BASE + len(self._ids)
            self._ids[piece] = found
            self._pieces[found] = piece
        return found

    piece_id = _id


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, or a list of parts (media become markers)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") in ("text", "input_text", "output_text"):
            out.append(str(part.get("text", "")))
        else:
            out.append(_MEDIA_PLACEHOLDER)
    return "".join(out)


def render_chat(
    messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool
) -> str:
    """ChatML, as Qwen's templates render it (without tools or thinking blocks)."""
    parts: list[str] = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        parts.append(f"<|im_start|>{msg.get('role', 'user')}\n{content_text(msg.get('content'))}")
        if not (continue_final_message and i == last):
            parts.append("<|im_end|>\n")
    if add_generation_prompt and not continue_final_message:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return content_text(msg.get("content"))
    return ""
