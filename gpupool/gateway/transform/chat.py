"""Chat-completion transforms for reasoning traces, on parsed JSON objects (no HTTP here).

* :class:`TransformOptions` — what one request needs (:meth:`TransformOptions.from_request`).
* :func:`transform_chat_response` — a whole non-streaming ``chat.completion`` body.
* :class:`ChatStreamTransformer` — ``chat.completion.chunk`` objects one at a time.
* :func:`normalize_request_messages` — assistant history carrying ``reasoning`` or
  ``reasoning_content``, renamed to the field the worker expects.

A choice whose message/delta already carries ``reasoning`` (vLLM ≥ 0.12 with a parser) or
``reasoning_content`` (older vLLM) is only renamed per ``field``. Otherwise, when a parser is
configured, ``content`` is split with it (:mod:`.reasoning`). The gateway never splits for a
worker running vLLM's own parser (:meth:`TransformOptions.for_worker`) nor a request bound by a
grammar (:func:`has_grammar`): the worker applies the grammar from the first token, so the
whole answer is content. Structured ``tool_calls`` are
never touched. Response objects are never mutated: changed ones are shallow copies, unchanged
ones are returned as the same object. Request normalisation edits the request body in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupool.config.models import ModelConfig, ReasoningField
from gpupool.config.models import ReasoningParser as ParserName
from gpupool.gateway.transform.reasoning import THINK_END, ReasoningParser, get_parser

REASONING_KEYS = ("reasoning", "reasoning_content")
_TEMPLATE_KEYS = ("id", "object", "created", "model")

Json = dict[str, Any]
CountTokens = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class TransformOptions:
    """How one request's response is reshaped.

    ``parser``: name of a gateway-side reasoning parser, or None when the worker splits (or no
    split is wanted). ``count_tokens``: a tokenizer-backed counter; without one the gateway never
    invents ``reasoning_tokens``.
    """

    parser: str | None = None
    field: ReasoningField = ReasoningField.reasoning
    include_reasoning: bool = True
    enable_thinking: bool = True
    start_in_reasoning: bool = True
    count_tokens: CountTokens | None = None
    zero_reasoning_tokens: bool = False  # a grammar turned the model's split off: report 0

    def __post_init__(self) -> None:
        if self.parser is not None:
            get_parser(self.parser)  # unknown names fail here, listing the known ones

    @classmethod
    def from_request(
        cls,
        model_cfg: ModelConfig,
        body: Mapping[str, Any],
        *,
        count_tokens: CountTokens | None = None,
        template_defaults: Mapping[str, Any] | None = None,
        worker_parser: str | None = None,
    ) -> TransformOptions:
        """``template_defaults``: the worker's ``--default-chat-template-kwargs``, if known.

        The gateway splits only when the model has a parser, the worker has none
        (``worker_parser``, see ``command.worker_reasoning_parser``) and the request carries no
        grammar (:func:`has_grammar`): a worker enforcing a grammar from the first token never
        writes ``<think>``, so its whole output is content.
        """
        parser = None if model_cfg.reasoning is ParserName.none else model_cfg.reasoning.value
        zero = parser is not None and worker_parser is None and has_grammar(body)
        if worker_parser is not None or zero:
            parser = None
        enable = _enable_thinking(body, template_defaults or {})
        start = enable
        if parser is not None and not get_parser(parser).uses_enable_thinking:
            start = True
        include = body.get("include_reasoning", True)
        return cls(
            parser=parser,
            field=model_cfg.reasoning_field,
            include_reasoning=include if isinstance(include, bool) else True,
            enable_thinking=enable,
            start_in_reasoning=start,
            count_tokens=count_tokens,
            zero_reasoning_tokens=zero,
        )

    @property
    def needs_transform(self) -> bool:
        """False when a vLLM ≥ 0.12 worker's response can be forwarded byte for byte."""
        return (
            self.parser is not None
            or self.field is not ReasoningField.reasoning
            or not self.include_reasoning
            or self.zero_reasoning_tokens
        )

    @property
    def keys(self) -> tuple[str, ...]:
        if self.field is ReasoningField.both:
            return REASONING_KEYS
        return (self.field.value,)

    def with_thinking(self, thinking: bool) -> TransformOptions:
        """These options for an answer made with ``enable_thinking`` = ``thinking`` (a stored
        response read again: its create's switch, ``pipeline/stored.py``)."""
        start = thinking or (
            self.parser is not None and not get_parser(self.parser).uses_enable_thinking
        )
        return dataclasses.replace(self, enable_thinking=thinking, start_in_reasoning=start)

    def for_worker(self, worker_parser: str | None) -> TransformOptions:
        """These options for a worker that runs ``worker_parser`` itself: never split again
        (renaming and ``include_reasoning`` still apply)."""
        if worker_parser is None or (self.parser is None and not self.zero_reasoning_tokens):
            return self
        return dataclasses.replace(self, parser=None, zero_reasoning_tokens=False)

    def new_parser(self) -> ReasoningParser | None:
        if self.parser is None:
            return None
        return get_parser(self.parser)(start_in_reasoning=self.start_in_reasoning)


_GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_GRAMMAR_FORMATS = ("json_object", "json_schema", "structural_tag")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def has_grammar(body: Mapping[str, Any]) -> bool:
    """Whether a chat, completion or responses request constrains its output with a grammar:
    ``response_format`` (or the Responses API's ``text.format``, Anthropic's
    ``output_config.format``) of a JSON type, vLLM's
    ``structured_outputs``, or its older ``guided_*`` fields. A regex, grammar or choice that
    spells ``</think>`` itself does not count: it writes the reasoning tags, so they split."""
    if _is_grammar_format(body.get("response_format")):
        return True
    text = body.get("text")
    if isinstance(text, dict) and _is_grammar_format(text.get("format")):
        return True
    so = body.get("structured_outputs")
    if isinstance(so, dict) and any(_constrains(so.get(k)) for k in _STRUCTURED_KEYS):
        return True
    output = body.get("output_config")  # Anthropic's: vLLM makes its schema a json_schema
    if isinstance(output, dict) and isinstance(output.get("format"), dict):
        return _constrains(output["format"].get("schema"))
    return any(_constrains(body.get(k)) for k in _GUIDED_KEYS)


def _constrains(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, str):
        return THINK_END not in value
    if isinstance(value, list):
        return not any(isinstance(v, str) and THINK_END in v for v in value)
    return True


def _is_grammar_format(fmt: Any) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") in _GRAMMAR_FORMATS


def _enable_thinking(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    merged = {**defaults, **(kwargs if isinstance(kwargs, dict) else {})}
    if merged.get("enable_thinking") is not None:
        return bool(merged["enable_thinking"])
    effort = body.get("reasoning_effort")
    if effort is not None:
        return bool(effort != "none")
    return True


def worker_reasoning(obj: Mapping[str, Any]) -> str | None:
    """The reasoning text a worker already split out, under either name."""
    for key in REASONING_KEYS:
        value = obj.get(key)
        if isinstance(value, str):
            return value
    return None


def _same(new: list[Any], old: list[Any]) -> bool:
    return all(a is b for a, b in zip(new, old, strict=True))


def _has_reasoning_key(obj: Mapping[str, Any]) -> bool:
    return any(key in obj for key in REASONING_KEYS)


# ---- non-streaming ------------------------------------------------------------------------


def transform_chat_response(body: Json, opts: TransformOptions) -> Json:
    choices = body.get("choices")
    if not isinstance(choices, list):
        return body
    reasoning_texts: list[str] = []
    new_choices = [_transform_choice(c, opts, reasoning_texts) for c in choices]
    usage = _usage_with_reasoning(body.get("usage"), reasoning_texts, opts)
    if usage is body.get("usage") and _same(new_choices, choices):
        return body
    out = {**body, "choices": new_choices}
    if usage is not None:
        out["usage"] = usage
    return out


def chat_reasoning_texts(body: Json, opts: TransformOptions) -> list[str]:
    """Each choice's reasoning in a worker's ``chat.completion`` body (split out by the worker,
    or by ``opts``' parser), whatever ``include_reasoning`` drops: vLLM counts
    ``reasoning_tokens`` either way."""
    texts: list[str] = []
    for choice in body.get("choices") or []:
        msg = choice.get("message") if isinstance(choice, dict) else None
        parts = _message_parts(msg, opts) if isinstance(msg, dict) else None
        if parts is not None and parts[0]:
            texts.append(parts[0])
    return texts


def all_reasoning(body: Json) -> bool:
    """No choice of a (transformed) ``chat.completion`` body has content or tool calls."""
    for choice in body.get("choices") or []:
        msg = choice.get("message") if isinstance(choice, dict) else None
        if isinstance(msg, dict) and (msg.get("content") or msg.get("tool_calls")):
            return False
    return True


def reasoning_token_count(usage: Mapping[str, Any], counted: int, all_reasoning: bool) -> int:
    """``reasoning_tokens`` for a gateway split: the whole completion when nothing but reasoning
    came out (exact, as vLLM counts token ids), else the text count re-tokenized by the worker,
    never more than the completion."""
    completion = usage.get("completion_tokens")
    if not isinstance(completion, int):
        return counted
    return completion if all_reasoning else min(counted, completion)


def _transform_choice(choice: Any, opts: TransformOptions, texts: list[str]) -> Any:
    msg = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(msg, dict):
        return choice
    parts = _message_parts(msg, opts)
    if parts is None:
        return choice
    reasoning, content = parts
    if reasoning is not None:
        texts.append(reasoning)
    new_msg = {k: v for k, v in msg.items() if k not in REASONING_KEYS}
    new_msg["content"] = content
    for key in opts.keys:
        new_msg[key] = reasoning if opts.include_reasoning else None
    if new_msg == msg:
        return choice
    return {**choice, "message": new_msg}


def _message_parts(msg: Json, opts: TransformOptions) -> tuple[str | None, Any] | None:
    """(reasoning, content) for a message, or None when the message needs no change."""
    existing = worker_reasoning(msg)
    content = msg.get("content")
    if existing is not None:
        return existing, content
    parser = opts.new_parser()
    if parser is not None and isinstance(content, str):
        return parser.split(content)
    if parser is not None or _has_reasoning_key(msg):
        return None, content
    return None


def _usage_with_reasoning(usage: Any, texts: list[str], opts: TransformOptions) -> Any:
    """Fill ``completion_tokens_details.reasoning_tokens`` when it can be counted honestly."""
    if isinstance(usage, dict) and opts.zero_reasoning_tokens:
        return _zero_reasoning(usage)
    if not isinstance(usage, dict) or opts.count_tokens is None:
        return usage
    if not texts and opts.parser is None:
        return usage
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        return usage  # the worker counted token ids; keep its number
    count = sum(opts.count_tokens(t) for t in texts if t)
    new_details = {**(details if isinstance(details, dict) else {}), "reasoning_tokens": count}
    return {**usage, "completion_tokens_details": new_details}


def _zero_reasoning(usage: Json) -> Json:
    """vLLM with a parser reports ``reasoning_tokens`` always; a grammar-bound answer has none."""
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
        return usage
    new_details = {**(details if isinstance(details, dict) else {}), "reasoning_tokens": 0}
    return {**usage, "completion_tokens_details": new_details}


# ---- streaming ----------------------------------------------------------------------------


@dataclass(slots=True)
class _ChoiceState:
    parser: ReasoningParser | None
    worker_splits: bool = False
    finished: bool = False
    answered: bool = False  # content or tool calls went out
    reasoning: list[str] = dataclasses.field(default_factory=list)

    @property
    def splitting(self) -> bool:
        return self.parser is not None and not self.worker_splits and not self.finished


class ChatStreamTransformer:
    """Reshape ``chat.completion.chunk`` objects for one streamed response.

    ``feed`` returns zero or more chunks per upstream chunk (chunks that need no change are
    returned as the same object); ``finish`` returns what was still held back, to be sent
    before ``[DONE]``. State is kept per choice ``index``.
    """

    def __init__(self, opts: TransformOptions) -> None:
        self._opts = opts
        self._choices: dict[int, _ChoiceState] = {}
        self._template: Json = {"object": "chat.completion.chunk"}

    def feed(self, chunk: Json) -> list[Json]:
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return [chunk]  # an error event, or something this transformer does not know
        if not choices:
            if "usage" not in chunk:
                return [chunk]
            return [*self.finish(), self._final_usage(chunk)]  # held text goes before usage
        self._template = {k: chunk[k] for k in _TEMPLATE_KEYS if k in chunk}
        new_choices = [self._choice(c) for c in choices]
        if _same(new_choices, choices):
            return [chunk]
        kept = [c for c in new_choices if c is not None]
        return [{**chunk, "choices": kept}] if kept else []

    def finish(self) -> list[Json]:
        out: list[Json] = []
        for index in sorted(self._choices):
            state = self._choices[index]
            if not state.splitting or state.parser is None:
                continue
            reasoning, content = state.parser.finish()
            state.finished = True
            delta = self._delta({}, reasoning, content, state)
            if delta:
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                out.append({**self._template, "choices": [choice]})
        return out

    def _state(self, choice: Json) -> _ChoiceState:
        index = choice.get("index", 0)
        key = index if isinstance(index, int) else 0
        if key not in self._choices:
            self._choices[key] = _ChoiceState(self._opts.new_parser())
        return self._choices[key]

    def _choice(self, choice: Any) -> Any:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            return choice
        state = self._state(choice)
        existing = worker_reasoning(delta)
        if existing is not None:
            state.worker_splits = True
        if state.splitting and state.parser is not None:
            new_delta = self._split(delta, state, choice.get("finish_reason") is not None)
        elif existing is not None or _has_reasoning_key(delta):
            new_delta = self._delta(delta, existing or "", None, state)
        else:
            return choice
        if new_delta == delta:
            return choice
        if not new_delta and choice.get("finish_reason") is None and not choice.get("logprobs"):
            return None  # nothing left to say in this chunk (held back, or reasoning dropped)
        return {**choice, "delta": new_delta}

    def _split(self, delta: Json, state: _ChoiceState, finishing: bool) -> Json:
        assert state.parser is not None
        text = delta.get("content")
        if text is not None and not isinstance(text, str):
            return delta  # not a text delta; leave it to the client
        reasoning, content = state.parser.feed(text) if text else ("", "")
        if finishing:
            r_tail, c_tail = state.parser.finish()
            reasoning, content = reasoning + r_tail, content + c_tail
            state.finished = True
        return self._delta(delta, reasoning, content, state)

    def _delta(self, delta: Json, reasoning: str, content: str | None, state: _ChoiceState) -> Json:
        """``delta`` with its reasoning renamed and, when ``content`` is given, replaced."""
        new = {k: v for k, v in delta.items() if k not in REASONING_KEYS}
        if content is not None:
            original = delta.get("content")
            empty = not content and "role" not in delta  # vLLM's parser sends no empty deltas
            if content != (original or "") or "content" not in delta or empty:
                new.pop("content", None)
                if content:
                    new["content"] = content
        if reasoning and (self._opts.count_tokens is not None or self._opts.parser is not None):
            state.reasoning.append(reasoning)  # to count once the usage chunk comes
        if reasoning and self._opts.include_reasoning:
            for key in self._opts.keys:
                new[key] = reasoning
        state.answered = state.answered or bool(new.get("content") or new.get("tool_calls"))
        return new

    @property
    def counts_later(self) -> bool:
        """The gateway splits but has no tokenizer at hand: the caller counts the reasoning
        (``reasoning_texts``) before the final usage chunk goes out."""
        return self._opts.parser is not None and self._opts.count_tokens is None

    @property
    def all_reasoning(self) -> bool:
        """No choice has sent content or tool calls (so far)."""
        return not any(s.answered for s in self._choices.values())

    def reasoning_texts(self) -> list[str]:
        """The reasoning the gateway split out, per choice."""
        return ["".join(s.reasoning) for s in self._choices.values() if s.reasoning]

    def _final_usage(self, chunk: Json) -> Json:
        texts = ["".join(s.reasoning) for s in self._choices.values()]
        counted = any(s.parser is not None or s.worker_splits for s in self._choices.values())
        if not counted and not self._opts.zero_reasoning_tokens:
            return chunk
        usage = _usage_with_reasoning(chunk.get("usage"), texts, self._opts)
        return chunk if usage is chunk.get("usage") else {**chunk, "usage": usage}


# ---- request side -------------------------------------------------------------------------


def normalize_request_messages(body: Json, worker_field: str = "reasoning") -> Json:
    """Rename ``reasoning``/``reasoning_content`` in message history to ``worker_field``.

    Edits ``body`` (the gateway's own parse of the request) in place and returns it, so both
    ``normalize_request_messages(body)`` and ``body = normalize_request_messages(body)`` work.
    """
    if worker_field not in REASONING_KEYS:
        raise ValueError(f"worker_field must be one of {', '.join(REASONING_KEYS)}")
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                _normalize_message(message, worker_field)
    return body


def _normalize_message(message: Json, worker_field: str) -> None:
    value = message.get("reasoning")
    if value is None:
        value = message.get("reasoning_content")
    for key in REASONING_KEYS:
        if key != worker_field or value is None:
            message.pop(key, None)
    if value is not None:
        message[worker_field] = value
