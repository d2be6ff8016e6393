"""A cheap, deterministic stand-in tokenizer and a ChatML chat template.

Pieces are the special markers, runs of up to four word characters, runs of whitespace, or
single other characters. Every piece holds at least one character, so a text never has more
tokens than UTF-8 bytes: the gateway's ``bytes >= tokens`` upper bound holds here as it does
for byte-level BPE.
"""

from __future__ import annotations

import re
from typing import Any

SPECIAL_IDS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667, "</think>": 151668}
_PIECE = re.compile(r"\w{1,4}|\s+|<(?:\|im_(?:start|end)\||/?think)>|[^\w\s]")
_FIRST_ID = 1000
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
        try:
            return "".join(self._pieces[i] for i in ids)
        except KeyError as exc:
            raise UnknownTokenId(f"Token id {exc.args[0]} is out of vocabulary") from None

    def piece_of(self, token_id: int) -> str:
        return self.decode([token_id])

    def _id(self, piece: str) -> int:
        found = self._ids.get(piece)
        if found is None:
            found = _FIRST_ID + len(self._ids)
            self._ids[piece] = found
            self._pieces[found] = piece
        return found


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
