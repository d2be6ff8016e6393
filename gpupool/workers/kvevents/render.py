"""A request's prompt token ids as vLLM computes them, from the model directory vLLM reads.

vLLM renders chat messages with the model's chat template (Jinja, as ``transformers`` sets it
up: sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its ``tojson``) and
tokenizes the text without special tokens; a completions prompt is tokenized with them. Only
what can be reproduced exactly is: messages of ``role`` and text ``content``, optional
``chat_template_kwargs`` and ``add_generation_prompt``. vLLM hands a template its messages'
content either as a string or as a list of text parts, by what the template's syntax tree reads
(``content_format.py``, detected once per template); the prompt is rendered once, in that form
(a worker started with ``--chat-template-content-format`` forcing the other form would be
predicted wrongly: that flag is not read). Where the template fails on that form, vLLM refuses
the request and its blocks are never cached; the other form is rendered then, so a simulator
given such a template (the tiny model's, which cannot add a system message's parts to a
string) still publishes and is routed on blocks. Anything else returns the reason it is not
modelled, and routing stays approximate.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from gpupool.workers.kvevents.content_format import detect

_MESSAGE_KEYS = frozenset({"role", "content"})
_ROLES = frozenset({"system", "user", "assistant"})
_CHAT_KEYS = frozenset({"chat_template", "tools", "documents", "continue_final_message",
                        "mm_processor_kwargs", "reasoning_effort", "lora_request"})  # fmt: skip
_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this line from system text


_DICT_ATTRIBUTES = frozenset(dir(dict))  # every name getattr finds on a plain dict
SAFE_ATTRIBUTES = 4096  # (type, name) answers of the sandbox remembered, at most
LONG_RUN = 256  # characters: a run this long is remembered (shorter ones cost less to encode)


class NotModelled(Exception):
    """The request's prompt cannot be computed exactly here (the message says why)."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, less Jinja's traceback rewriting: a template failing on a body
    (vLLM refuses it too) costs its error, not the rewriting of its traceback into template
    lines (never shown here). Its attribute check is remembered per type and name: Jinja's
    answer depends on nothing else (a leading underscore, the internal attributes of functions,
    methods, types, code, frames and generators, the mutating methods of lists, dicts, sets and
    their ABCs), and it was a third of a render (``namespace()`` reads, each many isinstance
    checks against ABCs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._safe: dict[tuple[type, str], bool] = {}

    def handle_exception(self, source: str | None = None) -> NoReturn:
        raise  # the error as it is (called only inside Template.render's ``except``)

    def getattr(self, obj: Any, attribute: str) -> Any:
        """``message.content`` on a plain dict: its item, as Jinja finds it after no attribute
        of that name (what a dict has, ``_DICT_ATTRIBUTES``, still goes Jinja's way), without
        raising and catching the AttributeError first."""
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except LookupError:  # a str key never raises TypeError on a dict
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < SAFE_ATTRIBUTES:  # names a template reads: a few dozen
                self._safe[key] = safe
        return safe


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SegmentEncoder:
    """The tokenizer's ``encode`` without special tokens, remembering long runs of text between
    its added tokens (``<|im_start|>``, ...): a long system prompt shared by many requests is
    tokenized once. Exact because the tokenizer itself splits there first and encodes each run
    on its own, when every added token matches as plain text (no ``lstrip``, ``rstrip``,
    ``single_word`` or ``normalized``); otherwise, or if any of the first ``checks`` encodings
    differs from the whole text's, it encodes whole texts only. What lies between the long runs
    (the added tokens, the short runs) is encoded in one call per stretch, so a short prompt is
    one call."""

    def __init__(self, tokenizer: Tokenizer, added: list[dict[str, Any]], entries: int = 256,
                 checks: int = 32) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        flags = ("lstrip", "rstrip", "single_word", "normalized")
        plain = all(not a.get(f) for a in added for f in flags)
        contents = sorted((a["content"] for a in added if a.get("content")), key=len, reverse=True)
        self.pattern = (
            re.compile("|".join(map(re.escape, contents))) if plain and contents else None
        )
        self.entries = entries
        self.checks = checks
        self._runs: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if self.pattern is None or len(text) < LONG_RUN:
            return self._whole(text)
        out: list[int] = []
        start = 0  # the stretch not yet encoded
        at = 0  # where the current run begins (after an added token)
        for m in self.pattern.finditer(text):
            if m.start() - at >= LONG_RUN:
                out += self._stretch(text, start, at)
                out += self._run(text[at : m.start()])
                start = m.start()
            at = m.end()
        if len(text) - at >= LONG_RUN:
            out += self._stretch(text, start, at)
            out += self._run(text[at:])
        else:
            out += self._stretch(text, start, len(text))
        if self.checks > 0:
            self.checks -= 1
            whole = self._whole(text)
            if whole != out:
                self.pattern = None
                return whole
        return out

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _stretch(self, text: str, start: int, end: int) -> list[int]:
        return self._whole(text[start:end]) if end > start else []

    def _run(self, text: str) -> list[int]:
        with self._lock:
            ids = self._runs.get(text)
            if ids is not None:
                self._runs.move_to_end(text)
                return ids
        ids = self._whole(text)
        with self._lock:
            self._runs[text] = ids
            if len(self._runs) > self.entries:
                self._runs.popitem(last=False)
        return ids


class PromptRenderer:
    """One model directory's tokenizer and chat template. Loading reads files: do it off the
    event loop (``load``); rendering is CPU work: run it in a thread too."""

    def __init__(
        self, tokenizer: Tokenizer, template: str | None, specials: dict[str, str],
        added: list[dict[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.specials = specials
        self.segments = SegmentEncoder(tokenizer, added or [])
        self.template: jinja2.Template | None = None
        self.content_format = "string"  # how vLLM hands the template a message's content
        if template is not None:
            env = _Sandbox(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            self.template = env.from_string(template)
            # each render copies its globals into a new context: from a dict, not a ChainMap
            self.template.globals = dict(self.template.globals)
            self.content_format = detect(env, template)

    @classmethod
    def load(cls, model_dir: str | Path) -> PromptRenderer:
        """From ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` (or the
        config's ``chat_template``). Raises NotModelled when there is no fast tokenizer."""
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise NotModelled(f"no tokenizer.json in {d}")
        raw = json.loads((d / "tokenizer.json").read_text())
        tok = Tokenizer.from_str(json.dumps(raw))
        added = [a for a in raw.get("added_tokens", []) if isinstance(a, dict)]
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        template: str | None = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        specials = {k: v for k in _SPECIALS if (v := _special(cfg.get(k))) is not None}
        return cls(tok, template, specials, added)

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The token ids vLLM will prefill for ``body`` on route ``path``."""
        if path == "/v1/completions":
            return self._completion(body)
        if path == "/v1/chat/completions":
            return self._chat(body)
        raise NotModelled(f"route {path}")

    def _completion(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise NotModelled("prompt is not one string or one token list")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)

    def _chat(self, body: dict[str, Any]) -> list[int]:
        if self.template is None:
            raise NotModelled("the model has no chat template")
        used = _CHAT_KEYS.intersection(body)
        if used:
            raise NotModelled(f"{sorted(used)[0]} is not modelled")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise NotModelled("chat_template_kwargs is not an object")
        texts = _texts(body.get("messages"))
        gen = body.get("add_generation_prompt", True)
        parts = self.content_format == "openai"
        text = self._render(_messages(texts, parts), gen, kwargs)
        if text is None:  # vLLM refuses it: its blocks as the other form gives them, if any
            text = self._render(_messages(texts, not parts), gen, kwargs)
        if text is None:
            raise NotModelled("the chat template fails on these messages")
        return self.segments.encode(text)

    def _render(
        self, messages: list[dict[str, Any]], gen: Any, kwargs: dict[str, Any]
    ) -> str | None:
        assert self.template is not None
        values = {**self.specials, **kwargs, "messages": messages, "tools": None,
                  "documents": None, "add_generation_prompt": bool(gen)}  # fmt: skip
        try:
            return self.template.render(**values)
        except jinja2.exceptions.TemplateError:
            return None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError):
            return None


def _messages(texts: list[tuple[str, str]], parts: bool) -> list[dict[str, Any]]:
    """The messages as the template gets them: each content a list of one text part, or text."""
    if parts:
        return [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in texts]
    return [{"role": r, "content": t} for r, t in texts]


def _texts(messages: Any) -> list[tuple[str, str]]:
    """``(role, text)`` per message (a single text part counts as its text)."""
    if not isinstance(messages, list) or not messages:
        raise NotModelled("messages is not a non-empty list")
    out: list[tuple[str, str]] = []
    for m in messages:
        if not (isinstance(m, dict) and _MESSAGE_KEYS.issuperset(m) and m.get("role") in _ROLES):
            raise NotModelled("a message other than role and text content")
        content = m.get("content")
        if isinstance(content, list):
            part = content[0] if len(content) == 1 else None
            if not (isinstance(part, dict) and part.get("type") == "text" and len(part) == 2):
                raise NotModelled("content other than one text part")
            content = part.get("text")
        if not isinstance(content, str):
            raise NotModelled("a message without text content")
        if m["role"] == "system" and content.startswith(_BILLING_HEADER):
            raise NotModelled("a system message with Claude Code's billing header")
        out.append((m["role"], content))
    return out
