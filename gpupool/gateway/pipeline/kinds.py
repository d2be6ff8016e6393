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
    salted: bool = False  # takes vLLM's `cache_salt`: set from the tenant when isolated
    method: str = "POST"
    stored: bool = False  # on a stored response (``{id}`` in the path): its worker, its tenant
    errors: Errors = Errors.openai
    thinking: bool = False  # takes Anthropic's `thinking`: mapped to the template's switch


def _generate(chat: bool) -> Reader:
    def read(raw: bytes, limits: ReadLimits) -> Parsed:
        return parse_generate(raw, chat=chat, max_depth=limits.max_depth, limits=limits)

    return read


_generating = partial(Kind, generates=True, salted=True)
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
        # /v2/embed: vLLM's Cohere request (``CohereEmbedRequest``) has no ``cache_salt`` and
        # drops unknown fields, so a salt would be ignored there (docs: Differences from vLLM)
        *(Kind(p, parse_model_body, salted=p != "/v2/embed") for p in _POOLING),
    )
}
"""Every POST route whose body reaches a worker; the front door serves exactly these."""


def _no_body(raw: bytes, limits: ReadLimits) -> Parsed:
    return Parsed({}, b"", None)


_RESPONSE = "/v1/responses/"
_stored = partial(Kind, read=_no_body, stored=True)

STORED: dict[tuple[str, str], Kind] = {
    (k.method, k.path.removeprefix(_RESPONSE + "{id}")): k
    for k in (
        # a response object comes back: split as its create was (``Shape.responses``)
        _stored("/v1/responses/{id}", method="GET", shape=Shape.responses),
        _stored("/v1/responses/{id}", method="DELETE"),
        _stored("/v1/responses/{id}/cancel", method="POST", shape=Shape.responses),
        _stored("/v1/responses/{id}/input_items", method="GET"),
    )
}
"""Routes on one stored response, by (method, what follows the id): sent to the worker that
stored it, for its tenant only (``pipeline/stored.py``)."""
_SUFFIXES = frozenset(suffix for _, suffix in STORED)
_MAX_ID = 256


def stored_target(path: str) -> tuple[str, str] | None:
    """(response id, suffix) when ``path`` names a stored response's route, else None."""
    if not path.startswith(_RESPONSE):
        return None
    rest = path[len(_RESPONSE) :]
    rid, slash, tail = rest.partition("/")
    suffix = slash + tail
    if not rid or len(rid) > _MAX_ID or suffix not in _SUFFIXES:
        return None
    return rid, suffix
