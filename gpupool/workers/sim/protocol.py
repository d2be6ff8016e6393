"""Request schemas: the fields the simulator reads, typed as vLLM types them.

Unknown fields are ignored (vLLM accepts and mostly ignores sampling knobs we do not model).
Parsing errors become :class:`InvalidBody` worded as vLLM's validation handler words them; a
validator that raises :class:`BadRequest` escapes pydantic, as vLLM's ``VLLMValidationError`` does.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError, model_validator

from gpupool.workers.sim.errors import BadRequest, InvalidBody, UnreadableBody

T = TypeVar("T", bound=BaseModel)


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Generate(BaseModel):
    model: str | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise BadRequest(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        opts = self.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)


class ChatRequest(_Generate):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True

    @property
    def enable_thinking(self) -> bool:
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            return bool(kwargs["enable_thinking"])
        if self.reasoning_effort is not None:
            return self.reasoning_effort != "none"
        return True

    @property
    def output_limit(self) -> tuple[str, int | None]:
        """The output-length parameter in force and its value."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_Generate):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": 16}
        return data


class ResponsesRequest(BaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool | None = False
    request_id: str | None = None  # vLLM makes it the response's id (``stored.py``)
    previous_response_id: str | None = None
    store: bool | None = True


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def _loads(body: bytes) -> Any:
    """orjson, and when it fails Python's ``json`` (what Starlette uses): vLLM reports that
    parser's position and wording, and accepts what it accepts (``NaN``, for one)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise InvalidBody.json_invalid(exc.pos, exc.msg) from None
    except (UnicodeDecodeError, RecursionError):
        raise UnreadableBody() from None


def parse_body(body: bytes, schema: type[T], media_ok: bool = True) -> T:
    """JSON bytes to a validated model, or :class:`InvalidBody`. ``media_ok`` is False when the
    request's content type is not ``application/json``: vLLM then refuses any body."""
    if not media_ok:
        raise InvalidBody.unsupported_media()
    if not body:
        raise InvalidBody.missing_body()
    data = _loads(body)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise InvalidBody.from_errors(errors) from None
