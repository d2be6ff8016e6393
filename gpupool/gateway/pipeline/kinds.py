"""The token-bearing routes, and the few ways they differ.

Every route here goes through the same pipeline (``pipeline.py``); a :class:`Kind` says only how
its body is read and what may be done to its answer. Adding a vLLM route is one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import partial

from gpupool.gateway.parse import (
    Parsed,
    ReadLimits,
    parse_generate,
    parse_messages,
    parse_model_body,
    parse_responses,
)

Reader = Callable[[bytes, ReadLimits], Parsed]


class Shape(StrEnum):
    """How an answer may be reshaped (reasoning split or rename)."""

    none = "none"
    chat = "chat"
    responses = "responses"
    messages = "messages"  # Anthropic's, from vLLM's adapter


class Errors(StrEnum):
    """The shape of the route's error bodies, as vLLM writes them."""

    openai = "openai"  # {"error": {message, type, param, code}}
    anthropic = "anthropic"  # vLLM's Anthropic adapter: {"type": "error", "error": {type, message}}


class Count(StrEnum):
    """How a prompt near a window is counted exactly (the worker's ``/tokenize``)."""

    none = "none"  # only the cheap bound; the worker judges
    chat = "chat"  # messages, with the chat template
    prompt = "prompt"  # a completions prompt


@dataclass(frozen=True, slots=True)
class Kind:
    path: str
    read: Reader
    shape: Shape = Shape.none
    count: Count = Count.none
    generates: bool = False  # spends completion tokens: reserved from max_tokens
    usage_option: bool = False  # streams take `stream_options.include_usage` (OpenAI's)
    errors: Errors = Errors.openai
    thinking: bool = False  # takes Anthropic's `thinking`: mapped to the template's switch


def _generate(chat: bool) -> Reader:
    def read(raw: bytes, limits: ReadLimits) -> Parsed:
        return parse_generate(raw, chat=chat, max_depth=limits.max_depth, limits=limits)

    return read


_generating = partial(Kind, generates=True)
_POOLING = ("/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score",
            "/rerank", "/v1/rerank", "/v2/rerank")  # fmt: skip

KINDS: dict[str, Kind] = {
    k.path: k
    for k in (
        _generating(
            "/v1/chat/completions", _generate(True), Shape.chat, Count.chat, usage_option=True
        ),
        _generating(
            "/v1/completions", _generate(False), Shape.none, Count.prompt, usage_option=True
        ),
        _generating("/v1/responses", parse_responses, Shape.responses),
        _generating(
            "/v1/messages", parse_messages, Shape.messages, errors=Errors.anthropic, thinking=True
        ),
        Kind("/v1/messages/count_tokens", parse_model_body, errors=Errors.anthropic, thinking=True),
        Kind("/tokenize", parse_model_body),
        Kind("/detokenize", parse_model_body),
        *(Kind(p, parse_model_body) for p in _POOLING),
    )
}
"""Every POST route whose body reaches a worker; the front door serves exactly these."""
