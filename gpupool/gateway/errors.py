"""The gateway's exception tree. Every error a client can see is one of these.

    GatewayError                     (500, InternalServerError)
    ├── BadRequest                   (400, BadRequestError)
    │   ├── InvalidBody              (400, "Bad Request": schema / JSON errors, as vLLM's validator)
    │   ├── ContextLengthExceeded    (400, param input_tokens)
    │   └── MediaRejected            (400, media limits and policies)
    ├── Unauthorized                 (401, AuthenticationError)
    ├── Forbidden                    (403, PermissionDeniedError)
    ├── NotFound                     (404, NotFoundError)
    │   └── ModelNotFound            (404, param model)
    ├── RequestTimeout               (408, a body that did not arrive in time)
    ├── ClientGone                   (499, the client left while its request waited; unseen)
    ├── PayloadTooLarge              (413, RequestEntityTooLarge)
    ├── RateLimited                  (429, RateLimitError, carries Retry-After)
    │   ├── QueueFull
    │   └── QueueTimeout
    ├── UpstreamError                (502, a worker failed in a way the client must hear about)
    │   └── UpstreamUnavailable      (503, no worker could take the request)
    └── ServiceUnavailable           (503, ServiceUnavailableError)

The body is always vLLM's envelope ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status equal to ``code``. Rendering lives in ``gateway/api/errors.py``; nothing else builds
error bodies. Messages never contain worker URLs or tracebacks.
"""

from __future__ import annotations

import math

import orjson


class GatewayError(Exception):
    status: int = 500
    type: str = "InternalServerError"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.body())

    def sse_event(self) -> bytes:
        """The in-stream form vLLM uses once a 200 has been sent: an error event, then [DONE]."""
        return b"data: " + self.to_json() + b"\n\ndata: [DONE]\n\n"


class BadRequest(GatewayError):
    status = 400
    type = "BadRequestError"


class InvalidBody(BadRequest):
    """Malformed JSON or wrong types. vLLM's request validator uses the HTTP phrase as type."""

    type = "Bad Request"


class ContextLengthExceeded(BadRequest):
    def __init__(self, max_model_len: int, prompt_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains at least {prompt_tokens} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_tokens})",
            param="input_tokens",
        )
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens


class MediaRejected(BadRequest):
    pass


class Unauthorized(GatewayError):
    status = 401
    type = "AuthenticationError"


class Forbidden(GatewayError):
    status = 403
    type = "PermissionDeniedError"


class NotFound(GatewayError):
    status = 404
    type = "NotFoundError"


class ModelNotFound(NotFound):
    def __init__(self, model: str, known: list[str]) -> None:
        super().__init__(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(known)}.",
            param="model",
        )


class PayloadTooLarge(GatewayError):
    status = 413
    type = "RequestEntityTooLarge"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "UnsupportedMediaTypeError"


class RequestTimeout(GatewayError):
    status = 408
    type = "RequestTimeout"


class ClientGone(GatewayError):
    """The client closed its connection while its request waited for a slot: never sent."""

    status = 499
    type = "ClientClosedRequest"


class RateLimited(GatewayError):
    status = 429
    type = "RateLimitError"

    def __init__(self, message: str, *, retry_after_s: float, param: str | None = None) -> None:
        self.retry_after_s = retry_after_s
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(message, param=param, headers={"retry-after": str(seconds)})


class QueueFull(RateLimited):
    pass


class QueueTimeout(RateLimited):
    pass


class UpstreamError(GatewayError):
    status = 502
    type = "BadGatewayError"


class UpstreamUnavailable(UpstreamError):
    status = 503
    type = "ServiceUnavailableError"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "ServiceUnavailableError"
