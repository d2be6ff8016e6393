"""A prompt no window holds gets vLLM's 400 on every route, in the route's own shape; a 503
only when a worker really failed (issue 27, API fidelity).

The workers are fakes that answer each route as vLLM 0.32 does (bodies copied from a real
worker): an OpenAI envelope on the OpenAI routes, Anthropic's ``{"type": "error", ...}`` on
``/v1/messages`` and its ``count_tokens``. Before the fix the gateway turned the last window's
400 into 503 "The worker failed (...) and no other worker can take it", which the SDKs retry twice.
"""

from __future__ import annotations

import orjson
import pytest

from gpupool.gateway.api.errors import error_reply
from gpupool.gateway.errors import GatewayError
from gpupool.gateway.pipeline.kinds import KINDS
from tests.gateway.test_pipeline import (
    MODEL,
    FakePath,
    FakeResponse,
    Rig,
    _finish,
    _handle,
    _windows_rig,
)

_MESSAGE = ("This model's maximum context length is {w} tokens. However, your prompt contains "
            "at least {n} input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value={n})")  # fmt: skip
_ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
LONG = "x" * 60_000  # by its bytes alone more than every window (2K and 8K)


def vllm_400(path: str, window: int) -> bytes:
    """vLLM's context-length 400 on ``path`` for a worker of ``window`` tokens."""
    message = _MESSAGE.format(w=window, n=window + 1)
    if path in _ANTHROPIC:
        return orjson.dumps({"type": "error",
                             "error": {"type": "BadRequestError", "message": message}})  # fmt: skip
    return orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                   "param": "input_tokens", "code": 400}})  # fmt: skip


def body_of(path: str, text: str) -> bytes:
    body: dict[str, object] = {"model": MODEL}
    if path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        body["messages"] = [{"role": "user", "content": text}]
    elif path == "/v1/completions":
        body["prompt"] = text
    elif path in ("/score", "/rerank"):
        body.update(query="q", documents=[text])
    else:
        body["input"] = text
    if path in ("/v1/messages", "/v1/completions", "/v1/chat/completions"):
        body["max_tokens"] = 4
    return orjson.dumps(body)


async def respond(r: Rig, path: str, raw: bytes) -> tuple[int, bytes]:
    """What the front door writes: the reply, or the error rendered for the route."""
    try:
        reply = await _handle(r, raw, path)
    except GatewayError as e:
        error = error_reply(e, KINDS[path])
        assert isinstance(error.body, bytes)
        return error.status, error.body
    return reply.status, await _finish(reply)


def too_long_everywhere(path: str) -> FakePath:
    """Two workers (2K, 8K windows) for which the prompt is too long; ``/tokenize`` counts it.
    Counted or not, the largest window says so itself: vLLM's message depends on the text (a
    long one is refused by its characters, ``param: input_text``), so the gateway never
    guesses it."""

    def answer(url: str, body: bytes) -> FakeResponse:
        window = 2048 if url.startswith("http://w0") else 8192
        if url.endswith("/tokenize"):
            return FakeResponse(body=orjson.dumps({"count": 20_000, "max_model_len": window}))
        return FakeResponse(400, vllm_400(path, window))

    return FakePath(answer)


ROUTES = ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings",
          "/v1/completions", "/v1/chat/completions", "/pooling", "/classify", "/score",
          "/rerank", "/v2/embed"]  # fmt: skip


@pytest.mark.parametrize("path", ROUTES)
async def test_a_prompt_no_window_holds_gets_vllms_400_in_the_routes_shape(path: str) -> None:
    r = _windows_rig(too_long_everywhere(path), (2048, 8192))
    status, out = await respond(r, path, body_of(path, LONG))
    assert status == 400, out
    generated = [u for u, _ in r.path.calls if not u.endswith("/tokenize")]
    assert generated == ["http://w1" + path]  # the largest window judged; nothing sent again
    assert out == vllm_400(path, 8192)  # the worker's own answer, byte for byte
    assert await r.held() == 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/embeddings"])
async def test_moved_to_the_larger_window_then_its_400(path: str) -> None:
    """Clear of the 2K window by the estimate, too long once there: moved to the 8K window,
    whose 400 is the answer (the retry is for a larger window, not for a failure)."""
    text = "x" * 5_000  # about 1,700 tokens at 3 bytes a token: the 2K window first
    r = _windows_rig(too_long_everywhere(path), (2048, 8192))
    status, out = await respond(r, path, body_of(path, text))
    assert status == 400, out
    assert [u.removeprefix("http://")[:2] for u, _ in r.path.calls] == ["w0", "w1"]
    assert out == vllm_400(path, 8192)
    assert all(w.consecutive_failures == 0 for w in r.registry)  # nobody failed
    assert await r.held() == 0


async def test_a_worker_that_really_fails_is_still_a_503() -> None:
    path = "/v1/messages"

    def answer(url: str, body: bytes) -> FakeResponse:
        return FakeResponse(500, b'{"error": "engine dead"}')

    r = _windows_rig(FakePath(answer), (8192, 8192))
    status, out = await respond(r, path, body_of(path, "hello"))
    assert status == 503  # both workers failed: retried once, then said
    assert orjson.loads(out)["error"]["type"] == "ServiceUnavailableError"
    assert await r.held() == 0
