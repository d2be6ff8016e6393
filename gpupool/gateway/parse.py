"""Parse only what a routing decision needs from a request body. No pydantic on the hot path.

Everything else in the body is forwarded to the worker byte for byte; vLLM validates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gpupool.gateway.errors import BadRequest, InvalidBody


@dataclass(slots=True)
class Generate:
    """A parsed /v1/chat/completions or /v1/completions body."""

    body: dict[str, Any]
    raw: bytes
    chat: bool
    model: str | None
    stream: bool
    max_tokens: int | None
    priority: int | None
    prefix_key: int | None


def _bad(msg: str, param: str | None = None) -> InvalidBody:
    return InvalidBody(f"1 validation error(s):\n  {msg}", param=param)


def load_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidBody(f"JSON decode error: {e.msg}") from None
    if not isinstance(obj, dict):
        raise _bad("body: Input should be a valid dictionary or object")
    # A body cannot nest deeper than its number of brackets: only walk when it could.
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth(obj) > max_depth:
        raise InvalidBody(f"JSON nesting deeper than {max_depth} levels")
    return obj


def _depth(obj: object) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, d)
            stack.extend((child, d + 1) for child in node if isinstance(child, dict | list))
    return deepest


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key}: Input should be a valid integer")
    if v < minimum:
        raise _bad(f"{key}: Input should be greater than or equal to {minimum}")
    return v


def _opt_bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{key}: Input should be a valid boolean")
    return v


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model: Input should be a valid string")
    return model or None


def parse_generate(raw: bytes, *, chat: bool, max_depth: int, max_n: int = 16) -> Generate:
    body = load_json(raw, max_depth)
    stream = _opt_bool(body, "stream")
    if body.get("stream_options") is not None and not stream:
        raise BadRequest(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            param="stream_options",
        )
    max_tokens = _opt_int(body, "max_completion_tokens" if chat else "max_tokens", 1)
    if chat and max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    priority = _opt_int(body, "priority", -(2**62))
    n = _opt_int(body, "n", 1)
    if n is not None and n > max_n:
        raise _bad(f"n: Input should be less than or equal to {max_n}", param="n")
    key = _chat_prefix(body) if chat else _completion_prefix(body)
    return Generate(body, raw, chat, _model(body), stream, max_tokens, priority, key)


def _chat_prefix(body: dict[str, Any]) -> int | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: Field required (a non-empty list)")
    parts: list[object] = []
    for m in messages[:2]:
        if not isinstance(m, dict):
            raise _bad("messages: each message must be an object")
        c = m.get("content")
        parts.append((m.get("role"), c if isinstance(c, str) else repr(c)[:4096]))
    return hash(tuple(parts))


def _completion_prefix(body: dict[str, Any]) -> int | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return hash(prompt[:1024])
    if prompt is None:
        raise _bad("prompt: Field required")
    return None


def parse_model_only(raw: bytes, max_depth: int) -> tuple[dict[str, Any], str | None]:
    """For pass-through POST routes: the model decides the worker; nothing else is read."""
    body = load_json(raw, max_depth)
    return body, _model(body)
