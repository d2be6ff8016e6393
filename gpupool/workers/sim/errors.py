"""The simulator's errors, rendered as vLLM renders them.

    SimError                 (500, InternalServerError: the injected engine failure)
    ├── BadRequest           (400, BadRequestError: vLLM's VLLMValidationError family)
    ├── InvalidBody          (400, "Bad Request": schema and JSON errors, as FastAPI + vLLM's
    │                         validation handler word them)
    ├── UnreadableBody       (400, FastAPI's own ``{"detail": …}``: bytes that are not text)
    └── ModelNotFound        (404, NotFoundError, param model)

``BadRequest`` appends `` (parameter=…, value=…)`` to its message as
``VLLMValidationError.__str__`` does. vLLM's ``VLLMValidationError`` is not a ``ValueError``,
so raised inside a pydantic validator it escapes validation and is rendered as itself: the
simulator's validators raise ``BadRequest`` for the same effect. The body is
``{"error": {message, type, param, code}}`` with the HTTP status equal to ``code``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"
_MAX_REPORTED = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


class SimError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str = ENGINE_DEAD, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.payload())


class BadRequest(SimError):
    status = 400
    type = "BadRequestError"

    def __init__(self, message: str, *, param: str | None = None, value: Any = None) -> None:
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={value}")
        full = f"{message} ({', '.join(extras)})" if extras else message
        super().__init__(full, param=param)


class InvalidBody(SimError):
    status = 400
    type = "Bad Request"

    @classmethod
    def from_errors(cls, errors: Sequence[dict[str, Any]]) -> InvalidBody:
        """Word pydantic errors (``loc`` already starting with ``"body"``) as vLLM does."""
        count = len(errors)
        label = "error" if count == 1 else "errors"
        lines = [f"{count} validation {label}:"]
        lines.extend(f"  {_format_error(e)}" for e in errors[:_MAX_REPORTED])
        if count > _MAX_REPORTED:
            lines.append(f"  ...and {count - _MAX_REPORTED} more {label}")
        return cls("\n".join(lines), param=_param_of(errors))

    @classmethod
    def missing_body(cls) -> InvalidBody:
        return cls.from_errors(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )

    @classmethod
    def unsupported_media(cls) -> InvalidBody:
        """FastAPI's dependency check of the content type (the error is a bare string)."""
        return cls(f"1 validation error:\n  {UNSUPPORTED_MEDIA}")

    @classmethod
    def json_invalid(cls, position: int, reason: str) -> InvalidBody:
        error = {
            "type": "json_invalid",
            "loc": ("body", position),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": reason},
        }
        return cls.from_errors([error])


class UnreadableBody(SimError):
    """FastAPI answers this itself, in its own shape."""

    status = 400

    def __init__(self) -> None:
        super().__init__("There was an error parsing the body")

    def payload(self) -> dict[str, Any]:
        return {"detail": self.message}


class ModelNotFound(SimError):
    status = 404
    type = "NotFoundError"

    def __init__(self, model: str, served: Sequence[str]) -> None:
        super().__init__(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
            param="model",
        )


def _param_of(errors: Sequence[dict[str, Any]]) -> str | None:
    return _clean_loc(errors[0].get("loc", ())) if errors else None


def _clean_loc(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _summarize(value: Any) -> Any:
    if isinstance(value, str):
        cut = len(value) > _MAX_INPUT_CHARS
        return value[:_MAX_INPUT_CHARS] + "...[truncated]" if cut else value
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def _format_error(error: dict[str, Any]) -> str:
    err = dict(error)
    if "input" in err:
        err["input"] = _summarize(err["input"])
    err["loc"] = _clean_loc(err.get("loc", ()))
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text
