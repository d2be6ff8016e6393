"""Continuing a chat or completions answer on another worker (request migration).

The route-shaped half of migration (``pipeline/migrate.py`` decides when, and moves the slot):

* :class:`Progress` reads a stream's events as the worker sends them and keeps what the client
  has been given: the text so far (the model's own text, before any reasoning split), how many
  token events carried it, and the ids every chunk carries (``id``, ``created``,
  ``system_fingerprint``).
* :func:`refusal` says why a request's answer cannot be continued exactly once it has begun
  (``n`` > 1, logprobs, a grammar, several prompts, ...); before any event went out it simply
  starts again.
* :func:`continuation` is the request the next worker gets: completions, the prompt plus the
  text so far; chat, the partial assistant message with vLLM's ``continue_final_message`` and
  no new generation prompt; ``max_tokens`` (and ``min_tokens``) less what was sent; everything
  else, sampling parameters and seed included, as it was.
* :class:`Resume` rewrites the next worker's events so the client's stream goes on as one: the
  first worker's ids in every chunk, no second ``role`` delta, and usage counted once (prompt
  tokens without the text fed back, completion tokens as the client received them).

A token is counted per event that carries text (vLLM sends one per engine step; the simulator
one per piece), an estimate where the worker merges steps; see docs/migration.md.
"""

from __future__ import annotations

from typing import Any

import orjson

from gpupool.gateway.transform.reframe import StreamProgress
from gpupool.gateway.transform.sse import EventBuffer
from gpupool.gateway.transform.token_ids import TokenIds, null_ids, strip

Json = dict[str, Any]

_IDS = ("id", "created", "system_fingerprint")
# Fields whose state a restart from the text so far cannot rebuild (a grammar's automaton, the
# token ids or logprobs already returned, several sequences).
_GRAMMAR = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structured_outputs", "guided_decoding_backend")  # fmt: skip
_TOKEN_STATE = ("logprobs", "top_logprobs", "prompt_logprobs", "return_tokens_as_token_ids",
                "return_token_ids", "echo", "suffix", "kv_transfer_params")  # fmt: skip
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


def refusal(body: Json, chat: bool) -> str | None:
    """Why an answer to ``body`` cannot be continued from its text once it has begun; None
    when it can. Each reason is documented in docs/migration.md."""
    n = body.get("n")
    if (isinstance(n, int) and n > 1) or (body.get("best_of") or 1) != 1:
        return "n>1"
    why = _token_state(body, chat)
    if why is not None:
        return why
    if chat:
        return _chat_refusal(body)
    if not isinstance(body.get("prompt"), str):
        return "prompt"  # several prompts or token ids
    return None


def _token_state(body: Json, chat: bool) -> str | None:
    for key in _TOKEN_STATE:
        value = body.get(key)
        if value is not None if key == "logprobs" and not chat else value not in (None, False, 0):
            return key
    for key in _GRAMMAR:
        value = body.get(key)
        if value is not None and not (key == "response_format" and _plain_text(value)):
            return "structured_outputs"
    return None


def _chat_refusal(body: Json) -> str | None:
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "structured_outputs"  # vLLM enforces these tool calls with a grammar
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages"
    if body.get("continue_final_message") and not isinstance(_content(messages[-1]), str):
        return "messages"
    return None


def _plain_text(value: object) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _content(message: object) -> object:
    return message.get("content") if isinstance(message, dict) else None


class Progress(StreamProgress):
    """What a chat or completions stream has given its client so far (choice 0: ``n`` > 1 is
    never continued): the text (the model's own, before any reasoning split) and the ids every
    chunk carries. ``broken``: a tool call or reasoning streamed; ``finished``: the finish
    reason went out. ``token_ids``: the ids its workers generated, when the gateway asked for
    them (``transform/token_ids.py``): kept, and taken out of the bytes that go out."""

    __slots__ = ("chat", "ids", "token_ids")

    def __init__(self, chat: bool) -> None:
        super().__init__()
        self.chat = chat
        self.ids: Json = {}
        self.token_ids: TokenIds | None = None

    @property
    def sent(self) -> int:
        """Tokens the client has: the ids generated, where the worker returned them (exact),
        else the events that carried text (an estimate where a worker merges steps)."""
        ids = self.token_ids
        return len(ids.generated) if ids is not None and ids.usable else self.tokens

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of what came so far, read, without the token ids the gateway
        asked for (the end of an unended one held back)."""
        data = super().feed(chunk)
        return strip(data) if self.token_ids is not None else data

    rewrite = feed  # the first worker's events go out as they came, less the ids

    def rest(self) -> bytes:
        rest = super().rest()
        return strip(rest) if self.token_ids is not None else rest

    def note(self, obj: Json) -> None:
        """One chunk object of the first worker as it came (its ids kept), as it goes out."""
        if self.token_ids is not None:
            self.token_ids.read(obj)
        self.note_text(obj)

    def note_text(self, obj: Json) -> None:
        """One chunk object as it goes to the client."""
        self.begun = True
        if not self.ids:
            self.ids = {k: obj[k] for k in _IDS if k in obj}
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._choice(choice)

    def _choice(self, choice: Json) -> None:
        if choice.get("finish_reason") is not None:
            self.finished = True
        if self.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return
            if delta.get("tool_calls"):
                self.broken = "tool_call"
            if delta.get("reasoning") or delta.get("reasoning_content"):
                self.broken = "reasoning"
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.parts.append(text)
            self.tokens += 1


def continuation(body: Json, chat: bool, progress: Progress) -> Json | None:
    """The request that continues ``body``'s answer after ``progress``; None when no token is
    left to generate (``max_tokens`` reached: the stream only needs its end)."""
    text, sent = progress.text, progress.sent
    if not text:
        return body  # nothing the client saw: the same request again
    out = dict(body)
    if chat:
        messages = list(body["messages"])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict):
            messages[-1] = {**last, "content": str(last.get("content") or "") + text}
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        limits: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    else:
        out["prompt"] = str(body["prompt"]) + text
        if "max_tokens" not in body:
            out["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
        limits = ("max_tokens",)
    for key in limits:
        limit = out.get(key)
        if isinstance(limit, int):
            if limit - sent < 1:
                return None
            out[key] = limit - sent
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens:
        out["min_tokens"] = max(0, min_tokens - sent)
    return out


class Resume:
    """Rewrites a continuing worker's events into the first worker's stream (see the module
    docstring); feeds ``progress`` so a further move continues from here."""

    __slots__ = ("_buf", "_first", "before", "progress", "prompt")

    def __init__(self, progress: Progress, prompt: int | None = None) -> None:
        self.progress = progress
        self.before = progress.sent  # tokens the client had before this worker
        # the original prompt's tokens (this worker's /tokenize); None: its prompt less the
        # tokens the client had, an estimate (a token boundary at the cut may differ)
        self.prompt = prompt
        self._buf = EventBuffer()
        self._first = progress.begun  # the client has its role delta: a second one is dropped

    def rewrite(self, chunk: bytes) -> bytes:
        out = bytearray()
        for payload in self._buf.events(chunk):
            if payload.startswith(b":"):
                out += payload + b"\n\n"
            elif payload == b"[DONE]":
                self.progress.done = True
                out += b"data: [DONE]\n\n"
            else:
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    out += b"data: " + payload + b"\n\n"
                    continue
                if isinstance(obj, dict) and (obj := self._read(obj)) is not None:
                    self.progress.note_text(obj)
                    out += b"data: " + orjson.dumps(obj) + b"\n\n"
        return bytes(out)

    def pending(self) -> int:
        """Bytes of an event not ended yet (bounded by the caller, as the relay's own)."""
        return len(self._buf)

    def _read(self, obj: Json) -> Json | None:
        """``obj`` as the client gets it: its token ids kept, then taken out."""
        ids = self.progress.token_ids
        if ids is not None:
            ids.read(obj)
            null_ids(obj)
        return self._one(obj)

    def _one(self, obj: Json) -> Json | None:
        obj.update(self.progress.ids)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = self.usage(usage)
        choices = obj.get("choices")
        if self.progress.chat and self._first and isinstance(choices, list) and choices:
            self._first = False
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict):
                    delta.pop("role", None)
                    if delta.get("content") == "":
                        del delta["content"]
            if not _carries(choices) and not isinstance(usage, dict):
                return None  # only the role the client already has
        return obj

    def usage(self, usage: Json) -> Json:
        """Usage counted once: the text fed back is not prompt, and is completion."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return usage
        prompt = self.prompt if self.prompt is not None else max(0, prompt - self.before)
        completion += self.before
        out = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
               "total_tokens": prompt + completion}  # fmt: skip
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = min(details["cached_tokens"], prompt)
            out["prompt_tokens_details"] = {**details, "cached_tokens": cached}
        return out


def _carries(choices: list[Any]) -> bool:
    """Whether a chunk's choices carry anything beyond an empty delta."""
    for choice in choices:
        if not isinstance(choice, dict):
            return True
        if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
            return True
        delta = choice.get("delta")
        if not isinstance(delta, dict) or any(v not in (None, "", []) for v in delta.values()):
            return True
    return False


def end_events(progress: Progress, chat: bool) -> bytes:
    """The end of a stream whose every token went out before its worker died: its finish
    reason (``length``) unless it went out already, and ``[DONE]`` unless it did (the worker
    died after writing it, before its body's end)."""
    out = b""
    if not progress.finished:
        choice: Json = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["delta"] = {}
            obj = {**progress.ids, "object": "chat.completion.chunk", "choices": [choice]}
        else:
            choice["text"] = ""
            obj = {**progress.ids, "object": "text_completion", "choices": [choice]}
        out = b"data: " + orjson.dumps(obj) + b"\n\n"
    return out + (b"" if progress.done else b"data: [DONE]\n\n")
