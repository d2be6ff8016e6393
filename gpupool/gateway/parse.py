"""Parse only what a decision needs from a request body. No pydantic on the hot path.

Everything else in the body is forwarded to the worker byte for byte; vLLM validates it.

Parsing cost is bounded before anything is parsed: a body may hold at most
``max_json_containers`` arrays and objects, counted from its bytes (every ``[`` and ``{``, so
brackets inside strings count too: an upper bound, read at C speed). Every walk over the parsed
body (depth, media parts, prefix) is linear in that count, so the worst body the limits allow
costs milliseconds, not seconds, and cannot stall other requests.
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import orjson

from gpupool.gateway.errors import BadRequest, InvalidBody

PRIORITY_BOUND = 2**62  # vLLM's priority is a Python int; keep it a sane machine integer
_PREFIX_CHARS = 4096
_MANY = 4096  # containers beyond which parsing and the depth check take their fast paths


@dataclass(frozen=True, slots=True)
class ReadLimits:
    max_depth: int = 64
    max_n: int = 16
    max_sequences: int = 256
    max_containers: int = 200_000


@dataclass(slots=True)
class Parsed:
    """The few fields of a request body the gateway decides on; ``body`` is the whole of it."""

    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool = False
    max_tokens: int | None = None
    priority: int | None = None
    prefix_key: int | None = None
    sequences: int = 1  # n x prompts: the sequences the worker will generate
    usage_asked: bool = True  # a stream's client asked for the usage chunk
    # bytes the worker reads more than once: a score or rerank query, paired with each document
    repeated_bytes: int = 0


def _bad(msg: str, param: str | None = None) -> InvalidBody:
    return InvalidBody(f"1 validation error(s):\n  {msg}", param=param)


def load_json(raw: bytes, max_depth: int, max_containers: int = 200_000) -> dict[str, Any]:
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > max_containers:
        raise InvalidBody(
            f"The body holds more than {max_containers} JSON arrays and objects "
            "(server.max_json_containers)."
        )
    try:
        obj = _loads(raw, containers)
    except orjson.JSONDecodeError as e:
        raise InvalidBody(f"JSON decode error: {e.msg}") from None
    if not isinstance(obj, dict):
        raise _bad("body: Input should be a valid dictionary or object")
    # A body cannot nest deeper than its number of brackets: only measure when it could.
    if containers > max_depth and _nesting(raw, obj, containers) > max_depth:
        raise InvalidBody(f"JSON nesting deeper than {max_depth} levels")
    return obj


def _nesting(raw: bytes, obj: object, containers: int) -> int:
    """How deep ``obj`` (parsed from ``raw``) nests: by walking it when it holds few
    containers, else from its bytes at C speed (strings removed, brackets summed)."""
    if containers < _MANY:
        return _depth(obj)
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def _loads(raw: bytes, containers: int) -> Any:
    """``orjson.loads``, without the cyclic collector running over the new containers.

    Parsing allocates one object per container; past a few thousand the collector's
    generational passes cost as much as the parse itself (measured: twice the time for
    100,000 nested arrays). The freshly parsed tree holds no cycles.
    """
    if containers < _MANY or not gc.isenabled():
        return orjson.loads(raw)
    gc.disable()
    try:
        return orjson.loads(raw)
    finally:
        gc.enable()


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


def _opt_int(
    body: dict[str, Any], key: str, minimum: int, maximum: int | None = None
) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key}: Input should be a valid integer", param=key)
    if v < minimum:
        raise _bad(f"{key}: Input should be greater than or equal to {minimum}", param=key)
    if maximum is not None and v > maximum:
        raise _bad(f"{key}: Input should be less than or equal to {maximum}", param=key)
    return v


def _opt_bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{key}: Input should be a valid boolean", param=key)
    return v


def _model(body: dict[str, Any], required: bool = False) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model: Input should be a valid string", param="model")
    if required and not model:
        raise _bad("model: Field required", param="model")
    return model or None


def _priority(body: dict[str, Any]) -> int | None:
    return _opt_int(body, "priority", -PRIORITY_BOUND, PRIORITY_BOUND)


def _stream(body: dict[str, Any]) -> bool:
    stream = _opt_bool(body, "stream")
    if body.get("stream_options") is not None and not stream:
        raise BadRequest(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            param="stream_options",
        )
    return stream


def _usage_asked(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _sequences(n: int, prompts: int, limits: ReadLimits) -> int:
    total = n * prompts
    if total > limits.max_sequences:
        raise _bad(
            f"n x prompts: {n} x {prompts} = {total} sequences; at most "
            f"{limits.max_sequences} per request (server.max_sequences)",
            param="n" if prompts == 1 else "prompt",
        )
    return total


# ---- one reader per API ------------------------------------------------------------------


def parse_generate(
    raw: bytes,
    *,
    chat: bool,
    max_depth: int,
    max_n: int = 16,
    limits: ReadLimits | None = None,
) -> Parsed:
    """/v1/chat/completions (``chat``) or /v1/completions."""
    lim = limits or ReadLimits(max_depth=max_depth, max_n=max_n)
    body = load_json(raw, lim.max_depth, lim.max_containers)
    get = body.get  # an absent field is read once, without a checker's call
    stream = _stream(body) if "stream" in body or "stream_options" in body else False
    field = "max_completion_tokens" if chat else "max_tokens"
    max_tokens = None if get(field) is None else _opt_int(body, field, 1)
    if chat and max_tokens is None and get("max_tokens") is not None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = 1 if get("n") is None else (_opt_int(body, "n", 1, lim.max_n) or 1)
    prompts = 1 if chat else _prompt_count(get("prompt"))
    key = _chat_prefix(body) if chat else _completion_prefix(body)
    model = get("model")
    if model is not None and type(model) is not str:
        model = _model(body)  # raises
    priority = None if get("priority") is None else _priority(body)
    sequences = n * prompts if n == 1 and prompts == 1 else _sequences(n, prompts, lim)
    usage = stream and _usage_asked(body)
    return Parsed(
        body, raw, model or None, stream, max_tokens, priority, key, sequences, usage
    )  # fmt: skip


def _prompt_count(prompt: object) -> int:
    """Prompts in a completions request: a string or token list is one; a list of them, many."""
    if prompt is None:
        raise _bad("prompt: Field required", param="prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def parse_responses(raw: bytes, limits: ReadLimits) -> Parsed:
    """/v1/responses: ``input`` (text or items), ``max_output_tokens``."""
    body = load_json(raw, limits.max_depth, limits.max_containers)
    if body.get("input") is None:
        raise _bad("input: Field required", param="input")
    max_tokens = _opt_int(body, "max_output_tokens", 1)
    key = _prefix_of(body.get("instructions"), body.get("input"))
    return Parsed(body, raw, _model(body), _opt_bool(body, "stream"), max_tokens,
                  _priority(body), key)  # fmt: skip


def parse_messages(raw: bytes, limits: ReadLimits) -> Parsed:
    """Anthropic-style /v1/messages: ``messages``, ``system``, ``max_tokens`` (required)."""
    body = load_json(raw, limits.max_depth, limits.max_containers)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: Field required (a non-empty list)", param="messages")
    max_tokens = _opt_int(body, "max_tokens", 1)
    key = _prefix_of(body.get("system"), messages)
    return Parsed(body, raw, _model(body, required=True), _opt_bool(body, "stream"),
                  max_tokens, None, key)  # fmt: skip


def parse_model_body(raw: bytes, limits: ReadLimits) -> Parsed:
    """Routes that generate nothing (embeddings, pooling, scores, tokenize, token counts): the
    model decides the worker; every input the worker runs counts as a sequence
    (``pooled_sequences``) against ``server.max_sequences``."""
    body = load_json(raw, limits.max_depth, limits.max_containers)
    n = _sequences(1, pooled_sequences(body), limits)
    return Parsed(body, raw, _model(body), sequences=n, repeated_bytes=_repeated(body, n))


# (first, second) fields of vLLM's score and rerank requests: a pair per item of the longer
_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                ("text_1", "text_2"))  # fmt: skip
_BATCHES = ("texts", "images", "inputs")  # Cohere's /v2/embed: one sequence per item


def pooled_sequences(body: dict[str, Any]) -> int:
    """The sequences a pooling, score or rerank request makes the worker run.

    Score and rerank: one per (query, document) pair, vLLM pairing a single query with every
    document (5,000 documents are 5,000 sequences). Embeddings, classify, pooling: one per
    ``input`` item (a string or a token list; a chat conversation in ``input`` is one) or per
    conversation of a batched ``messages``. Cohere's ``/v2/embed``: one per item.
    """
    pair = _pair(body)
    if pair is not None:
        return max(_items(pair[0]), _items(pair[1]))
    for name in _BATCHES:
        value = body.get(name)
        if isinstance(value, list):
            return _items(value)
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], list):
        return len(messages)  # batched conversations
    inputs = body.get("input")
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int | dict):
        return len(inputs)
    return 1


def _repeated(body: dict[str, Any], pairs: int) -> int:
    """The bytes of a single score or rerank query the worker reads once more per further
    pair (each pair is its own prompt), so that a key's token budget counts them."""
    pair = _pair(body) if pairs > 1 else None
    query = pair[0] if pair is not None else None
    if isinstance(query, list):
        if len(query) != 1:
            return 0  # as many queries as documents: each is read once
        query = query[0]
    return (pairs - 1) * len(orjson.dumps(query)) if query is not None else 0


def _pair(body: dict[str, Any]) -> tuple[object, object] | None:
    """(queries, documents) of a score or rerank body (rerank's single ``query`` too)."""
    for first, second in _SCORE_PAIRS:
        if second in body:
            return body.get(first, body.get("query")), body[second]
    return None


def _items(value: object) -> int:
    return len(value) if isinstance(value, list) and value else 1


# ---- prefix keys (affinity) ----------------------------------------------------------------


def _chat_prefix(body: dict[str, Any]) -> int | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: Field required (a non-empty list)", param="messages")
    parts: list[object] = []
    for m in _opening(messages):
        if not isinstance(m, dict):
            raise _bad("messages: each message must be an object", param="messages")
        parts.append((m.get("role"), _text_of(m.get("content"))))
    return hash(tuple(parts))


def _opening(items: list[Any]) -> list[Any]:
    """A conversation's opening: its items up to and including the first user turn (at most
    four), the same in every later turn of it (turn 2 adds the answer and a new question)."""
    for i, item in enumerate(items[:4]):
        if isinstance(item, dict) and item.get("role") == "user":
            return items[: i + 1]
    return items[:2]


def _completion_prefix(body: dict[str, Any]) -> int | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return hash(prompt[:1024])
    if prompt is None:
        raise _bad("prompt: Field required", param="prompt")
    return None


def _prefix_of(first: object, items: object) -> int | None:
    """A conversation's key: its instructions/system text and its opening items."""
    head = _opening(items) if isinstance(items, list) else [items]
    return hash((_text_of(first), *(_text_of(i) for i in head)))


def _text_of(value: object, depth: int = 0) -> str:
    """A bounded text for hashing: strings as they are (cut), containers by their first parts,
    three levels deep at most.

    Never ``repr`` of a whole value: a client controls its size (seconds for a few MiB).
    """
    if isinstance(value, str):
        return value[:_PREFIX_CHARS]
    if depth >= 3 or not isinstance(value, dict | list):
        return str(value)[:64] if not isinstance(value, dict | list) else "…"
    if isinstance(value, dict):
        items = list(value.items())[:8]
        return "{" + ",".join(f"{k}:{_text_of(v, depth + 1)}" for k, v in items) + "}"
    return "[" + ",".join(_text_of(v, depth + 1) for v in value[:8]) + "]"


def owned_prefix_key(key: int | None, owner: str | None) -> int | None:
    """A prefix key that names its owner (the tenant, when caches are isolated:
    ``tenancy/cache.py``): the same opening from two tenants is two conversations, so affinity
    never leads one tenant to the worker holding another's prefix."""
    if key is None or owner is None:
        return key
    return hash((owner, key))
