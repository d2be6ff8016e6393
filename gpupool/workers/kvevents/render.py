"""A request's prompt token ids as vLLM computes them, from the model directory vLLM reads.

vLLM renders chat messages with the model's chat template (Jinja, as ``transformers`` sets it
up: sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its ``tojson``) and
tokenizes the text without special tokens; a completions prompt is tokenized with them. Only
what can be reproduced exactly is: messages of ``role`` and text ``content``, optional
``chat_template_kwargs`` and ``add_generation_prompt``. vLLM hands a template its messages'
content either as a string or as a list of text parts, by what the template reads; both are
rendered here and must agree (a template that fails on one form fails in vLLM too or is never
given it). Anything else returns the reason it is not modelled, and routing stays approximate.
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

_MESSAGE_KEYS = frozenset({"role", "content"})
_ROLES = frozenset({"system", "user", "assistant"})
_CHAT_KEYS = frozenset({"chat_template", "tools", "documents", "continue_final_message",
                        "mm_processor_kwargs", "reasoning_effort", "lora_request"})  # fmt: skip
_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


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
    """transformers' sandbox, less Jinja's traceback rewriting: one of a message's two forms
    fails on most templates (``_chat``), every request, and rewriting that error's traceback
    into template lines (never shown here) was half of the rendering's time."""

    def handle_exception(self, source: str | None = None) -> NoReturn:
        raise  # the error as it is (called only inside Template.render's ``except``)


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class SegmentEncoder:
    """The tokenizer's ``encode`` without special tokens, remembering the runs of text between
    its added tokens (``<|im_start|>``, ...): a long system prompt shared by many requests is
    tokenized once. Exact because the tokenizer itself splits there first and encodes each run
    on its own, when every added token matches as plain text (no ``lstrip``, ``rstrip``,
    ``single_word`` or ``normalized``); otherwise, or if any of the first ``checks`` encodings
    differs from the whole text's, it encodes whole texts only."""

    def __init__(self, tokenizer: Tokenizer, added: list[dict[str, Any]], entries: int = 256,
                 checks: int = 32) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        flags = ("lstrip", "rstrip", "single_word", "normalized")
        plain = all(not a.get(f) for a in added for f in flags)
        contents = sorted((a["content"] for a in added if a.get("content")), key=len, reverse=True)
        self.ids = {a["content"]: a["id"] for a in added}
        self.pattern = (
            re.compile("(" + "|".join(map(re.escape, contents)) + ")")
            if plain and contents
            else None
        )
        self.entries = entries
        self.checks = checks
        self._runs: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if self.pattern is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        out: list[int] = []
        for i, part in enumerate(self.pattern.split(text)):
            if i % 2:
                out.append(self.ids[part])
            elif part:
                out += self._run(part)
        if self.checks > 0:
            self.checks -= 1
            whole = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
            if whole != out:
                self.pattern = None
                return whole
        return out

    def _run(self, text: str) -> list[int]:
        with self._lock:
            ids = self._runs.get(text)
            if ids is not None:
                self._runs.move_to_end(text)
                return ids
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if len(text) >= 256:  # short runs cost less to encode than to keep
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
        if template is not None:
            env = _Sandbox(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            self.template = env.from_string(template)

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
        plain = [{"role": r, "content": t} for r, t in texts]
        parts = [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in texts]
        a, b = self._render(plain, gen, kwargs), self._render(parts, gen, kwargs)
        if a is None and b is None:
            raise NotModelled("the chat template fails on these messages")
        if a is not None and b is not None and a != b:
            raise NotModelled("the template renders string and list content differently")
        text = a if a is not None else b
        assert text is not None
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
        out.append((m["role"], content))
    return out
