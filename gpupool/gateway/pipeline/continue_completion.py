"""A chat answer whose text the chat template rewrites goes on as a completion (migration).

Continuing a chat answer sends the partial assistant message with ``continue_final_message``
(``transform/continuation.py``). Some templates rewrite that message: Qwen3's keeps only what
follows the last ``</think>`` of an assistant turn, so a partial answer holding one (a reasoning
model served without a reasoning parser, once past its reasoning) is refused by vLLM ("the final
message does not appear in the chat after applying the chat template"). Such an answer goes on
as a completion of vLLM's own rendering instead::

    the original messages ── new worker's /tokenize (chat form, generation prompt) ──▶ prompt ids
    the partial answer    ── /tokenize (no special tokens) ──────────────────────────▶ its ids
    POST /v1/completions {prompt: both, the chat's sampling parameters and seed,
                          max_tokens less the tokens sent} (stream)
    its text_completion chunks ── AsChat ──▶ the client's chat.completion.chunk stream

The relay takes this way at once when the text holds a marker the template is known to cut
(``cut``) or the gateway splits the model's reasoning (its raw text holds ``<think>``, which no
assistant message hands back), and whenever vLLM refuses the chat continuation so
(``refused``). The prompt is the
one the first worker read, token for token, except where the partial text tokenizes otherwise
than the tokens generated (a token boundary at the cut: docs/migration.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson

from gpupool.gateway.errors import GatewayError
from gpupool.gateway.pipeline.dispatch import Dispatcher
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.tokens import tokenize, tokenize_body
from gpupool.gateway.transform.continuation import Progress, Resume
from gpupool.gateway.upstream.client import DataPath
from gpupool.workers.registry import Registry

Json = dict[str, Any]
log = logging.getLogger("gpupool.migrate")

CUT_MARKERS = ("</think>",)  # the reasoning end Qwen3's (and DeepSeek-R1's) templates cut at
_REFUSED = b"final message does not appear in the chat"  # transformers' words, vLLM's 400
# a chat request's fields a completion request has no use for (the rest pass: sampling, seed,
# stop, stream_options, cache_salt, ...)
_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template",
              "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
              "documents", "mm_processor_kwargs", "media_io_kwargs", "reasoning_effort",
              "include_reasoning", "max_completion_tokens", "add_special_tokens", "echo",
              "functions", "function_call")  # fmt: skip


def cut(text: str) -> bool:
    """Whether a known chat template would rewrite an assistant message holding ``text``."""
    return any(m in text for m in CUT_MARKERS)


def refused(data: bytes) -> bool:
    """Whether a worker's answer is vLLM's refusal of a rewritten final message."""
    return _REFUSED in data


def text_only(origin: Json) -> bool:
    """Whether the answer can go on as plain text: every message is text (token ids carry no
    image or audio), and no tool may be called (a completion's text is not parsed into
    ``tool_calls``)."""
    if origin.get("tools") and origin.get("tool_choice") != "none":
        return False
    for message in origin.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(p, dict) or p.get("type") != "text" for p in content
        ):
            return False
    return True


def completion_body(origin: Json, ids: list[int], sent: int, room: int) -> Json | None:
    """The completions request that continues ``origin``'s chat answer from the token ids
    ``ids`` (the rendered prompt and the partial answer), after ``sent`` tokens went out;
    ``room``: the window left after ``ids``. None when no token is left to generate."""
    out = {k: v for k, v in origin.items() if k not in _CHAT_ONLY}
    out["prompt"] = ids
    limit = origin.get("max_completion_tokens") or origin.get("max_tokens")
    left = limit - sent if isinstance(limit, int) else room  # chat's default: the window
    if min(left, room) < 1:
        return None
    out["max_tokens"] = min(left, room)
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens:
        out["min_tokens"] = max(0, min_tokens - sent)
    return out


async def send_completion(dispatcher: Dispatcher, ex: Exchange, body: Json) -> bytes | None:
    """Send ``body`` to ``ex``'s worker as ``POST /v1/completions`` in place of the request:
    None when it answered, else why not (the error's message). The request's own body and
    path come back after, so a further move continues from the request."""
    plan = ex.plan
    kept, plan.body, plan.target = plan.body, orjson.dumps(body), "/v1/completions"
    try:
        return await dispatcher.send(ex)
    except GatewayError as err:
        return err.message.encode()
    finally:
        plan.body, plan.target = kept, ""


def as_chat(obj: Json) -> Json:
    """A ``text_completion`` chunk as the ``chat.completion.chunk`` it stands for."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return obj
    out = []
    for c in choices:
        if not isinstance(c, dict):
            continue
        text = c.get("text")
        chat = {"index": c.get("index", 0), "delta": {"content": text} if text else {},
                "logprobs": None, "finish_reason": c.get("finish_reason")}  # fmt: skip
        if "stop_reason" in c:
            chat["stop_reason"] = c["stop_reason"]
        out.append(chat)
    return {**obj, "object": "chat.completion.chunk", "choices": out}


class AsChat(Resume):
    """A completion's events rewritten into the client's chat stream: as chat chunks, then as
    any continuation (the first worker's ids, usage counted once: ``prompt`` is the rendered
    prompt's tokens, so the partial answer fed back counts as completion only)."""

    __slots__ = ()

    def _one(self, obj: Json) -> Json | None:
        return super()._one(as_chat(obj))


class CompletionContinuation:
    """Opens a chat answer's continuation as a completion on the exchange's (new) worker."""

    def __init__(self, dispatcher: Dispatcher, client: DataPath, registry: Registry) -> None:
        self.dispatcher = dispatcher
        self.client = client
        self.registry = registry

    async def open(self, ex: Exchange, origin: Json, progress: Progress) -> AsChat | bytes:
        """Send the completion (``ex.resp`` set): its rewriter, or why not (the worker's
        answer or the gateway's words, for the caller's log)."""
        if not text_only(origin):
            return b"not continued as a completion: media or tools"

        def body(ids: list[int], room: int) -> Json | None:
            return completion_body(origin, ids, progress.tokens, room)

        render = _render_req(origin, ex.plan.model.name)
        why = "the chat template rewrites the partial answer"
        prompt = await self.send(ex, render, progress.text, body, why)
        return prompt if isinstance(prompt, bytes) else AsChat(progress, prompt)

    async def send(
        self,
        ex: Exchange,
        render: Json,
        text: str,
        body: Callable[[list[int], int], Json | None],
        why: str,
    ) -> int | bytes:
        """The completion that goes on from vLLM's rendering, sent to the exchange's (new)
        worker (``ex.resp`` set): ``render`` (a chat-form ``/tokenize`` request) rendered,
        ``text`` (the answer so far) tokenized after it, ``body(ids, room)`` the completion's
        body. Returns the rendered prompt's tokens, or why not (the worker's answer or the
        gateway's words, for the caller's log); ``why``: the log line's reason."""
        plan = ex.plan
        worker = self.registry.get(ex.worker)
        if worker is None or worker.url is None:
            return b"the worker is gone"
        rendered = await self.ids(worker.url, {"model": plan.model.name, **render})
        answer = {"model": plan.model.name, "prompt": text, "add_special_tokens": False}
        partial = await self.ids(worker.url, answer)
        if rendered is None or partial is None:
            return b"the worker's /tokenize could not render the prompt"
        ids, window = rendered[0] + partial[0], rendered[1] or worker.window or 0
        sent = body(ids, window - len(ids))
        if sent is None:
            return b"no room left in the window"
        data = await send_completion(self.dispatcher, ex, sent)
        if data is not None:
            return data
        log.warning("request %s: continued on worker %s as a completion of %d prompt and %d "
                    "answer tokens (%s)", plan.ctx.request_id, ex.worker, len(rendered[0]),
                    len(partial[0]), why)  # fmt: skip
        return len(rendered[0])

    async def ids(self, url: str, req: Json) -> tuple[list[int], int | None] | None:
        """``tokens`` and ``max_model_len`` of the worker's ``/tokenize`` for ``req``."""
        obj = await tokenize(self.client, url, req)
        if obj is None:
            return None
        tokens = obj.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        window = obj.get("max_model_len")
        return tokens, window if isinstance(window, int) else None


def _render_req(origin: Json, model: str) -> Json:
    """The chat-form ``/tokenize`` of the original request as vLLM renders it to generate:
    its template, kwargs and tools, the generation prompt (or its own final message
    continued, when it asked for that)."""
    req = tokenize_body(origin, model, chat=True) or {}
    if origin.get("continue_final_message"):
        req["add_generation_prompt"] = False
    if "add_special_tokens" in origin:
        req["add_special_tokens"] = origin["add_special_tokens"]
    return req
