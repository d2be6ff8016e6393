"""Counting prompt tokens: cheaply where it does not matter, exactly where it does.

Byte-level BPE tokens (Qwen's, and most others) never outnumber the UTF-8 bytes they encode, and a
JSON body is at least as long as the text it carries, so ``len(body) + TEMPLATE_SLACK`` bounds the
prompt from above. Only when that bound reaches a window is the worker's own ``/tokenize`` asked
(with the messages, so the chat template is counted).
"""

from __future__ import annotations

from typing import Any

import orjson

from gpupool.gateway.upstream.client import DataPath, UpstreamFailure

TEMPLATE_SLACK = 256  # tokens a chat template may add beyond the body's bytes
_CHAT_KEYS = ("chat_template", "chat_template_kwargs", "tools", "add_generation_prompt",
              "continue_final_message", "mm_processor_kwargs")  # fmt: skip


def upper_bound(raw: bytes) -> int:
    return len(raw) + TEMPLATE_SLACK


def tokenize_body(body: dict[str, Any], model: str, chat: bool) -> dict[str, Any] | None:
    if chat:
        out: dict[str, Any] = {"model": model, "messages": body.get("messages")}
        out.update({k: body[k] for k in _CHAT_KEYS if k in body})
        out.setdefault("add_generation_prompt", True)
        return out
    prompt = body.get("prompt")
    return {"model": model, "prompt": prompt} if isinstance(prompt, str) else None


async def exact_count(
    client: DataPath, worker_url: str, body: dict[str, Any], model: str, chat: bool
) -> int | None:
    """The worker's own count, or None when it cannot tell (the worker will judge)."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    req = tokenize_body(body, model, chat)
    return None if req is None else await tokenize_count(client, worker_url, req)


async def tokenize_count(client: DataPath, worker_url: str, req: dict[str, Any]) -> int | None:
    """``count`` from the worker's ``/tokenize`` for ``req``, or None when it cannot tell."""
    obj = await tokenize(client, worker_url, req)
    count = obj.get("count") if obj is not None else None
    return count if isinstance(count, int) else None


async def tokenize(client: DataPath, worker_url: str, req: dict[str, Any]) -> dict[str, Any] | None:
    """The worker's ``/tokenize`` answer to ``req`` (an object), or None: it failed, refused or
    answered something else."""
    try:
        resp = await client.open(
            "POST", f"{worker_url}/tokenize", orjson.dumps(req),
            {"content-type": "application/json"},
        )  # fmt: skip
        data = await resp.read()
    except UpstreamFailure:
        return None
    if resp.status != 200:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
