"""From a validated request to a :class:`Job`: the checks vLLM runs before generating
(model name, ``max_tokens``, context length), the rendered prompt and the planned outputs."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.engine import Admission
from gpupool.workers.sim.errors import BadRequest, ModelNotFound
from gpupool.workers.sim.protocol import ChatRequest, CompletionRequest
from gpupool.workers.sim.text import Output, TextSource
from gpupool.workers.sim.tokenize import (
    Tokenizer,
    UnknownTokenId,
    content_text,
    last_user_text,
    render_chat,
)


@dataclass(slots=True)
class Meta:
    """What the transport learned from the request line and headers."""

    request_id: str | None = None
    hold_s: float = 0.0
    arrival: float = 0.0
    media_ok: bool = True  # content type application/json


@dataclass(slots=True)
class Job:
    response_id: str
    created: int
    model: str
    prompt: str
    prompt_tokens: int
    outputs: list[Output]
    admission: Admission
    include_usage: bool = False
    continuous_usage: bool = False
    fingerprint: str = ""
    thinking: bool | None = None  # None: no reasoning parser
    include_reasoning: bool = True
    # with ``return_token_ids``: the prompt's ids and each output's, a piece a token
    prompt_ids: list[int] | None = None
    output_ids: list[list[int]] | None = None

    @property
    def steps(self) -> int:
        return max(1, max(len(o.pieces) for o in self.outputs))

    @property
    def generated(self) -> int:
        return sum(len(o.pieces) for o in self.outputs)

    @property
    def finish_reasons(self) -> list[str]:
        return [o.finish_reason for o in self.outputs]


class JobBuilder:
    def __init__(self, config: SimConfig, tokenizer: Tokenizer, text: TextSource) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.text = text
        self.names = config.served_names
        self.fingerprint = config.system_fingerprint

    def check_model(self, model: str | None) -> None:
        if model and model not in self.names:
            raise ModelNotFound(model, self.names)

    def chat(self, req: ChatRequest, meta: Meta) -> Job:
        self.check_model(req.model)
        if req.continue_final_message and req.add_generation_prompt:
            raise BadRequest(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        param, requested = req.output_limit
        _check_n(req.n)
        self._check_requested(param, requested)
        prompt = render_chat(req.messages, req.add_generation_prompt, req.continue_final_message)
        pieces = self.tokenizer.pieces(prompt)
        self._check_prompt_len(len(pieces))
        budget = self._budget(len(pieces), requested)
        prefix = _final_assistant_text(req.messages) if req.continue_final_message else ""
        echo = last_user_text(req.messages)
        outputs = [self.text.plan(echo, budget, i, prefix) for i in range(req.n)]
        parser_on = self.config.reasoning_parser is not None
        job = self._job("chatcmpl-", prompt, pieces, outputs, meta)
        job.include_usage, job.continuous_usage = req.include_usage, req.continuous_usage
        job.thinking = req.enable_thinking if parser_on else None
        job.include_reasoning = req.include_reasoning
        if req.return_token_ids:
            self._ids(job, self.tokenizer.encode(prompt))
        return job

    def completion(self, req: CompletionRequest, meta: Meta) -> Job:
        self.check_model(req.model)
        _check_n(req.n)
        self._check_requested("max_tokens", req.max_tokens)
        prompts = self._prompts(req.prompt)
        for _, pieces in prompts:  # vLLM renders every prompt before it sizes any output
            self._check_prompt_len(len(pieces))
        outputs: list[Output] = []
        all_pieces: list[str] = []
        for text, pieces in prompts:
            budget = self._budget(len(pieces), req.max_tokens)
            outputs.extend(
                self.text.plan(text, budget, i, self.text.written(text, i)) for i in range(req.n)
            )
            all_pieces.extend(pieces)
        job = self._job("cmpl-", prompts[0][0], all_pieces, outputs, meta)
        job.include_usage, job.continuous_usage = req.include_usage, req.continuous_usage
        if req.return_token_ids:
            first = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            if isinstance(first, str):
                self._ids(job, self.tokenizer.encode(first))
            elif isinstance(first, int):
                self._ids(job, [int(t) for t in req.prompt if isinstance(t, int)])
            else:
                self._ids(job, list(first))
        return job

    def _ids(self, job: Job, prompt_ids: list[int]) -> None:
        """The ids a stream returns when asked (``return_token_ids``)."""
        job.prompt_ids = prompt_ids
        job.output_ids = [[self.tokenizer.piece_id(p) for p in o.pieces] for o in job.outputs]

    def _job(
        self, prefix: str, prompt: str, pieces: list[str], outputs: list[Output], meta: Meta
    ) -> Job:
        base = meta.request_id or secrets.token_hex(8)  # vLLM: 16 hex digits
        planned = sum(len(o.pieces) for o in outputs)
        lens = tuple(len(o.pieces) for o in outputs)
        adm = Admission(base, pieces, planned, meta.hold_s, meta.arrival, lens, prompt[:64])
        job = Job(prefix + base, int(time.time()), self.names[0], prompt, len(pieces), outputs, adm)
        job.fingerprint = self.fingerprint
        return job

    def _prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[tuple[str, list[str]]]:
        """``(text, pieces)`` per prompt; token-id prompts count their ids."""
        items: Sequence[Any] = [prompt] if isinstance(prompt, str) else prompt
        if items and isinstance(items[0], int):
            items = [items]
        if not items:
            raise BadRequest(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        return [self._one_prompt(p) for p in items]

    def _one_prompt(self, prompt: str | list[int]) -> tuple[str, list[str]]:
        if isinstance(prompt, str):
            self._text_len_check(prompt)
            return prompt, self.tokenizer.pieces(prompt)
        try:
            text = self.tokenizer.decode(prompt)
        except UnknownTokenId:
            text = ""
        return text, [str(t) for t in prompt]

    def _text_len_check(self, text: str) -> None:
        """vLLM refuses raw text longer than window x longest token before tokenizing it."""
        limit = self.config.max_model_len
        max_chars = limit * MAX_CHARS_PER_TOKEN
        if len(text) > max_chars:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {len(text)} characters (more than {max_chars} characters, which is "
                f"the upper bound for {limit} input tokens). Please reduce the length of the "
                "input prompt.",
                param="input_text",
                value=len(text),
            )

    def _check_requested(self, param: str, requested: int | None) -> None:
        limit = self.config.max_model_len
        if requested is not None and requested > limit:
            raise BadRequest(
                f"{param}={requested} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param=param,
                value=requested,
            )

    def _check_prompt_len(self, prompt_len: int) -> None:
        limit = self.config.max_model_len
        if prompt_len > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {limit + 1} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
                value=limit + 1,
            )

    def _budget(self, prompt_len: int, requested: int | None) -> int:
        """Output tokens allowed: the request's limit (or the whole rest of the window) clamped
        to what is left of the window. Under 1 (a prompt that fills the window, or a bad limit)
        it fails as vLLM's sampling parameters do, always naming ``max_tokens``."""
        room = self.config.max_model_len - prompt_len
        budget = room if requested is None else min(requested, room)
        if budget < 1:
            raise BadRequest(
                f"max_tokens must be at least 1, got {budget}.", param="max_tokens", value=budget
            )
        return budget


# vLLM bounds raw prompt text by ``max_model_len x`` its tokenizer's longest token string; the
# simulator's longest pieces are its special tokens (``<|im_start|>``: 12 characters).
MAX_CHARS_PER_TOKEN = 12


def _check_n(n: int) -> None:
    if n < 1:
        raise BadRequest(f"n must be at least 1, got {n}.", param="n", value=n)


def _final_assistant_text(messages: list[dict[str, Any]]) -> str:
    if messages and messages[-1].get("role") == "assistant":
        return content_text(messages[-1].get("content"))
    return ""
