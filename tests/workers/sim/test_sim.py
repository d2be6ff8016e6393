"""The vLLM simulator, over real HTTP: uvicorn on loopback ports, the openai client and httpx."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from gpupool.workers.sim.app import create_sim_app
from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.reasoning import Qwen3Splitter, split_all
from gpupool.workers.sim.text import chunk_chars
from gpupool.workers.sim.tokenize import Tokenizer, render_chat
from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[3]
FINGERPRINT = re.compile(r"vllm-0\.32\.0-[0-9a-f]{8}")
SCRIPT = "<think>Let me think.\nStep two.</think>\n\nThe answer is 42."
KNOB_DEFAULTS = {
    "fail_rate": 0.0,
    "hang": False,
    "health_fail": False,
    "crash_after_tokens": None,
    "ttft_ms": 0.0,
    "itl_ms": 0.0,
}


@contextmanager
def serve(config: SimConfig) -> Iterator[str]:
    """The sim under uvicorn in a thread, on a free loopback port."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_sim_app(config),
            host="127.0.0.1",
            port=0,
            http="httptools",
            access_log=False,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    config = SimConfig(
        model="sim-model",
        served_model_names=["alias"],
        max_model_len=256,
        max_num_seqs=4,
        mode="echo",
    )
    with serve(config) as url:
        yield url


@pytest.fixture(scope="module")
def reasoner_url() -> Iterator[str]:
    config = SimConfig(
        model="qwen",
        mode="script",
        script=SCRIPT,
        script_chunking="chars",
        reasoning_parser="qwen3",
        seed=7,
    )
    with serve(config) as url:
        yield url


@pytest.fixture
async def http(sim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim_url, timeout=10) as client:
        yield client
        await client.post("/sim/control", json=KNOB_DEFAULTS)
        await client.post("/sim/reset")


@pytest.fixture
def oai(sim_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim_url + "/v1", api_key="none", max_retries=0)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def oai_user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


def sse_events(raw: bytes) -> list[Any]:
    """Split an SSE body, checking vLLM's framing: only ``data: …\\n\\n`` events, [DONE] last."""
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    out: list[Any] = []
    for event in events[:-2]:
        assert event.startswith(b"data: ")
        out.append(orjson.loads(event[6:]))
    return out


# -- shapes -------------------------------------------------------------------------------------


async def test_models_list_matches_vllm_card(
    http: httpx.AsyncClient, oai: openai.AsyncOpenAI
) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == ["sim-model", "alias"]
    card = (await http.get("/v1/models")).json()["data"][0]
    assert list(card) == [
        "id",
        "object",
        "created",
        "owned_by",
        "root",
        "parent",
        "max_model_len",
        "permission",
    ]
    assert (card["owned_by"], card["root"], card["max_model_len"]) == (
        "vllm",
        "/models/sim-model",
        256,
    )
    assert card["permission"][0]["object"] == "model_permission"
    assert (await http.get("/health")).content == b""
    assert (await http.get("/version")).json() == {"version": "0.32.0"}


async def test_chat_non_streaming_body_has_vllm_fields(
    http: httpx.AsyncClient, oai: openai.AsyncOpenAI
) -> None:
    resp = await oai.chat.completions.create(model="alias", messages=oai_user("hello world"))
    assert resp.choices[0].message.content == "hello world"
    assert resp.model == "sim-model"
    assert resp.choices[0].finish_reason == "stop"
    body = (await http.post("/v1/chat/completions", json={"messages": user("hi")})).json()
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert list(body["choices"][0]["message"]) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    ]
    assert body["usage"]["completion_tokens"] == 1
    assert body["usage"]["completion_tokens_details"] is None
    assert FINGERPRINT.fullmatch(body["system_fingerprint"])
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["id"])


async def test_chat_stream_framing_and_usage_chunk(http: httpx.AsyncClient) -> None:
    req = {
        "messages": user("one two three"),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = await http.post("/v1/chat/completions", json=req)
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["vary"] == "Origin" and "content-length" not in resp.headers
    chunks = sse_events(resp.content)
    first, *deltas, last = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" in first
    assert "".join(c["choices"][0]["delta"]["content"] for c in deltas) == "one two three"
    assert deltas[-1]["choices"][0]["finish_reason"] == "stop"
    assert "stop_reason" not in deltas[0]["choices"][0]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == len(deltas)
    assert len({c["id"] for c in chunks}) == 1
    # the fingerprint is on the last JSON chunk only: here the usage chunk
    assert list(last) == ["id", "object", "created", "model", "choices", "usage",
                          "system_fingerprint"]  # fmt: skip
    assert FINGERPRINT.fullmatch(last["system_fingerprint"])
    assert all("system_fingerprint" not in c for c in chunks[:-1])


async def test_stream_without_usage_puts_the_fingerprint_on_each_finishing_chunk(
    http: httpx.AsyncClient,
) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": user("a b c"), "n": 2}),
        ("/v1/completions", {"prompt": "a b c", "n": 2}),
    ):
        chunks = sse_events((await http.post(path, json={**body, "stream": True})).content)
        stamped = [c for c in chunks if "system_fingerprint" in c]
        assert [c["choices"][0]["index"] for c in stamped] == [0, 1]
        assert all(c["choices"][0]["finish_reason"] == "stop" for c in stamped)
        assert all(list(c)[-1] == "system_fingerprint" for c in stamped)
        unstamped = [c for c in chunks if "system_fingerprint" not in c]
        assert all(c["choices"][0]["finish_reason"] is None for c in unstamped)


async def test_continuous_usage_chunks(http: httpx.AsyncClient) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    req = {"messages": user("a b"), "stream": True, "stream_options": opts}
    _, *deltas, last = sse_events((await http.post("/v1/chat/completions", json=req)).content)
    assert [d["usage"]["completion_tokens"] for d in deltas] == [1, 2, 3]
    assert all(d["usage"]["completion_tokens_details"] is None for d in deltas)
    assert "completion_tokens_details" not in last["usage"]
    req = {"prompt": "a b", "stream": True, "stream_options": opts}
    *chunks, _ = sse_events((await http.post("/v1/completions", json=req)).content)
    assert list(chunks[0]["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]


async def test_openai_client_streams_the_same_text(oai: openai.AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model="sim-model",
        messages=oai_user("stream me please"),
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text == "stream me please"
    assert usage is not None and usage.completion_tokens > 0


async def test_n_choices_have_indexes(http: httpx.AsyncClient) -> None:
    body = (await http.post("/v1/chat/completions", json={"messages": user("x y"), "n": 3})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    req = {"messages": user("x y"), "n": 2, "stream": True}
    chunks = sse_events((await http.post("/v1/chat/completions", json=req)).content)
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


async def test_completions_stream_and_not(http: httpx.AsyncClient) -> None:
    body = (await http.post("/v1/completions", json={"prompt": "say this", "max_tokens": 2})).json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == "say "
    req = {"prompt": "say this", "stream": True, "stream_options": {"include_usage": True}}
    *chunks, usage = sse_events((await http.post("/v1/completions", json=req)).content)
    assert list(chunks[0]["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "token_ids",
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "say this"
    assert usage["usage"] == {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}


# -- errors -------------------------------------------------------------------------------------


async def test_unknown_model_is_404_and_empty_model_is_fine(
    http: httpx.AsyncClient, oai: openai.AsyncOpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await oai.chat.completions.create(model="foo", messages=oai_user("x"))
    assert info.value.body == {
        "message": "The model `foo` does not exist. Valid aliases: sim-model, alias.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    resp = await http.post("/v1/chat/completions", json={"model": "", "messages": user("x")})
    assert resp.status_code == 200


async def test_context_length_errors_and_clamp(http: httpx.AsyncClient) -> None:
    long = {"messages": user("word " * 300)}
    error = (await http.post("/v1/chat/completions", json=long)).json()["error"]
    assert error["param"] == "input_tokens"
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. "
        "However, your prompt contains at least 257 input tokens"
    )
    assert error["message"].endswith("(parameter=input_tokens, value=257)")
    resp = await http.post("/v1/chat/completions", json={"messages": user("x"), "max_tokens": 999})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(
        "max_tokens=999 cannot be greater than max_model_len=256. Please request fewer output "
        "tokens."
    )
    fits = {"messages": user("word " * 120), "max_tokens": 200}  # prompt + max_tokens > 256
    body = (await http.post("/v1/chat/completions", json=fits)).json()
    assert body["usage"]["total_tokens"] == 256
    assert body["choices"][0]["finish_reason"] == "length"
    for bad in (-1, 0):  # always named max_tokens, as vLLM's sampling parameters name it
        req = {"messages": user("x"), "max_completion_tokens": bad}
        error = (await http.post("/v1/chat/completions", json=req)).json()["error"]
        assert error["message"] == (
            f"max_tokens must be at least 1, got {bad}. (parameter=max_tokens, value={bad})"
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_filling_the_window_is_a_plain_400(
    http: httpx.AsyncClient, stream: bool
) -> None:
    """max_tokens is clamped to 0 first, for stream and non-stream alike; one token less fits."""
    for prompt, max_tokens in (([7] * 256, None), ("a " * 128, 5)):  # both 256 tokens long
        req = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        resp = await http.post("/v1/completions", json=req)
        assert resp.status_code == 400
        assert resp.headers["content-type"] == "application/json"
        assert resp.json() == {"error": {
            "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "type": "BadRequestError", "param": "max_tokens", "code": 400}}  # fmt: skip
    req = {"prompt": "a " * 127 + "a", "max_tokens": 5, "stream": stream}
    resp = await http.post("/v1/completions", json=req)
    body = sse_events(resp.content)[-1] if stream else resp.json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("a", "length")


async def test_default_max_tokens_16_for_completions_and_the_window_for_chat() -> None:
    with serve(SimConfig(max_model_len=40, output_tokens=100)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            text = (await client.post("/v1/completions", json={"prompt": "hi"})).json()
            chat = (await client.post("/v1/chat/completions", json={"messages": user("hi")})).json()
    assert text["usage"]["completion_tokens"] == 16
    assert chat["usage"]["total_tokens"] == 40
    assert chat["choices"][0]["finish_reason"] == "length"


JSON_TYPE = {"content-type": "application/json"}


UNSUPPORTED = "Unsupported Media Type: Only 'application/json' is allowed"


@pytest.mark.parametrize(
    ("payload", "headers", "param", "detail"),
    [
        (b'{"messages": "hi"}', JSON_TYPE, "body.messages", "'Input should be a valid list'"),
        (b'{"messages": [], "max_tokens": "many"}', JSON_TYPE, "body.max_tokens", "'int_parsing'"),
        # JSON errors are worded, and placed, as Python's json module does
        (b'{"model" "x"}', JSON_TYPE, "body.9", "\"Expecting ':' delimiter\""),
        (b'{"model": "x', JSON_TYPE, "body.10", "'Unterminated string starting at'"),
        (b"", JSON_TYPE, "body", "'Field required'"),
        (b'{"messages": []}', {}, None, UNSUPPORTED),  # no content type
        (b'{"messages": []}', {"content-type": "text/plain"}, None, UNSUPPORTED),
    ],
)
async def test_malformed_bodies_are_bad_request(
    http: httpx.AsyncClient, payload: bytes, headers: dict[str, str], param: str, detail: str
) -> None:
    resp = await http.post("/v1/chat/completions", content=payload, headers=headers)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("Bad Request", 400, param)
    assert error["message"].startswith("1 validation error:\n  ")
    assert detail in error["message"]


async def test_a_body_that_is_not_text_is_unparsable(http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/completions", content=b'{"prompt": "\xff"}', headers=JSON_TYPE)
    assert (resp.status_code, resp.json()) == (
        400,
        {"detail": "There was an error parsing the body"},
    )


async def test_stream_options_without_stream_is_a_validation_error(http: httpx.AsyncClient) -> None:
    """vLLM's VLLMValidationError escapes pydantic: not a schema error, other errors unseen."""
    for body in ({"messages": user("x")}, {"messages": "not a list"}, {"prompt": "x"}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        resp = await http.post(path, json={**body, "stream_options": {"include_usage": True}})
        assert (resp.status_code, resp.json()) == (400, {"error": {
            "message": "Stream options can only be defined when `stream=True`. "
                       "(parameter=stream_options)",
            "type": "BadRequestError", "param": "stream_options", "code": 400}})  # fmt: skip


async def test_unregistered_routes_and_wrong_methods_are_fastapi_shaped(
    http: httpx.AsyncClient,
) -> None:
    resp = await http.post("/v1/embeddings", json={"input": "x"})
    assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})
    assert resp.headers["vary"] == "Origin"
    resp = await http.get("/v1/chat/completions")
    assert (resp.status_code, resp.json()) == (405, {"detail": "Method Not Allowed"})
    assert resp.headers["allow"] == "POST"


# -- capacity, cancellation, faults ------------------------------------------------------------


async def test_max_num_seqs_is_respected_and_the_rest_wait(http: httpx.AsyncClient) -> None:
    async def one(i: int, hold_ms: int) -> int:
        headers = {"x-sim-hold-ms": str(hold_ms), "x-request-id": f"r{i}"}
        req = {"messages": user(f"req {i}")}
        return (await http.post("/v1/chat/completions", json=req, headers=headers)).status_code

    # the first four must still run when the other sixteen are seen waiting: 3 s leaves a loaded
    # machine ten times what it takes quietly (it failed at 300 ms beside three xdist workers)
    first = [asyncio.create_task(one(i, 3000)) for i in range(4)]
    await _until(http, lambda s: s["running"] == 4)
    rest = [asyncio.create_task(one(i, 5)) for i in range(4, 20)]
    await _until(http, lambda s: s["waiting"] == 16)
    metrics = (await http.get("/metrics")).text
    assert 'vllm:num_requests_running{engine="0",model_name="sim-model"} 4.0' in metrics
    assert 'vllm:num_requests_waiting{engine="0",model_name="sim-model"} 16.0' in metrics
    assert await asyncio.gather(*first, *rest) == [200] * 20
    stats = (await http.get("/sim/stats")).json()
    assert stats["peak_running"] == 4
    assert sorted(stats["request_ids"]) == sorted(f"r{i}" for i in range(20))
    assert (stats["running"], stats["waiting"], stats["completed_total"]) == (0, 0, 20)


async def _until(http: httpx.AsyncClient, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll /sim/stats until ``ok`` holds (ten seconds at most)."""
    deadline = time.monotonic() + 10
    while True:
        stats: dict[str, Any] = (await http.get("/sim/stats")).json()
        if ok(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"condition never held: {stats}")
        await asyncio.sleep(0.005)


async def test_disconnect_mid_stream_frees_the_slot(http: httpx.AsyncClient) -> None:
    await http.post("/sim/control", json={"itl_ms": 30})
    req = {"messages": user("a b c d e f g h i j k l"), "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=req) as resp:
        async for _ in resp.aiter_bytes():
            break
        assert (await http.get("/sim/stats")).json()["running"] == 1
    stats = await _until(http, lambda s: s["running"] == 0)
    assert (stats["running"], stats["aborted_total"], stats["completed_total"]) == (0, 1, 0)
    assert 'finished_reason="abort"' in (await http.get("/metrics")).text


async def test_disconnect_while_queued_never_runs(http: httpx.AsyncClient) -> None:
    hold = {"x-sim-hold-ms": "3000"}  # still running when `late` has queued and left (as above)
    busy = [
        asyncio.create_task(
            http.post("/v1/chat/completions", json={"messages": user("x")}, headers=hold)
        )
        for _ in range(4)
    ]
    await _until(http, lambda s: s["running"] == 4)
    late = asyncio.create_task(
        http.post(
            "/v1/chat/completions",
            json={"messages": user("late")},
            headers={"x-request-id": "gave-up"},
        )
    )
    await _until(http, lambda s: s["waiting"] == 1)
    late.cancel()  # the client gives up: httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await late
    await _until(http, lambda s: s["waiting"] == 0)
    assert (await http.get("/sim/stats")).json()["running"] == 4
    await asyncio.gather(*busy)
    stats = (await http.get("/sim/stats")).json()
    assert "gave-up" not in stats["request_ids"]
    assert (stats["running"], stats["waiting"]) == (0, 0)


async def test_fault_knobs(http: httpx.AsyncClient) -> None:
    await http.post("/sim/control", json={"fail_rate": 1.0, "health_fail": True})
    resp = await http.post(
        "/v1/chat/completions", json={"messages": user("x")}, headers={"x-request-id": "failed-1"}
    )
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "InternalServerError"
    assert "failed-1" not in (await http.get("/sim/stats")).json()["request_ids"]
    assert (await http.get("/health")).status_code == 503
    await http.post("/sim/control", json={"fail_rate": 0.0, "health_fail": False, "hang": True})
    with pytest.raises(httpx.ReadTimeout):
        await http.get("/health", timeout=0.1)
    pending = asyncio.create_task(http.post("/v1/chat/completions", json={"messages": user("y")}))
    await asyncio.sleep(0.05)
    assert not pending.done()
    await http.post("/sim/control", json={"hang": False})
    assert (await pending).status_code == 200
    bad = await http.post("/sim/control", json={"nope": 1})
    assert bad.status_code == 400


async def test_request_id_header_names_the_response(http: httpx.AsyncClient) -> None:
    resp = await http.post(
        "/v1/chat/completions", json={"messages": user("x")}, headers={"x-request-id": "abc123"}
    )
    assert resp.json()["id"] == "chatcmpl-abc123"
    assert (await http.get("/sim/stats")).json()["request_ids"] == ["abc123"]


@contextmanager
def sim_process(*args: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m gpupool.workers.sim`` on a free port, healthy; killed at the end."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpupool.workers.sim", "--port", str(port), *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def test_crash_after_tokens_kills_the_process_mid_stream() -> None:
    args = (
        "--mode",
        "lorem",
        "--output-tokens",
        "50",
        "--crash-after-tokens",
        "3",
        "--itl-ms",
        "5",
    )
    with sim_process(*args) as (url, proc):
        received = b""
        with (
            pytest.raises(httpx.HTTPError),
            httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                json={"messages": user("x"), "stream": True},
                timeout=5,
            ) as resp,
        ):
            for part in resp.iter_bytes():
                received += part
        assert proc.wait(timeout=5) == 1
        contents = [c for c in received.split(b"\n\n") if b'"content"' in c]
        assert len(contents) == 4  # the role chunk and three tokens
        assert b"[DONE]" not in received


ENGINE_DEAD_EVENT = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for '
    b'the root cause.", "type": "InternalServerError", "param": null, "code": 500}}'
)


def test_sigterm_kills_the_engine_like_vllm_and_exits_0() -> None:
    """vLLM's default shutdown aborts: a started stream gets the (spaced) error event and
    [DONE], a request still waiting gets a 500, and the process exits with status 0."""
    args = ("--mode", "lorem", "--output-tokens", "500", "--itl-ms", "20")
    with sim_process(*args) as (url, proc):
        held: list[httpx.Response] = []
        req = {"messages": user("x")}

        def wait_in_the_engine() -> None:
            hold = {"x-sim-hold-ms": "20000"}
            held.append(httpx.post(url + "/v1/chat/completions", json=req, headers=hold))

        waiter = threading.Thread(target=wait_in_the_engine)
        waiter.start()
        while httpx.get(url + "/sim/stats").json()["running"] < 1:
            time.sleep(0.01)
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**req, "stream": True}, timeout=10
        ) as resp:
            chunks = resp.iter_raw()
            raw = next(chunks)
            proc.send_signal(signal.SIGTERM)
            raw += b"".join(chunks)
        waiter.join(10)
        assert proc.wait(timeout=10) == 0
    assert raw.split(b"\n\n")[-3:] == [ENGINE_DEAD_EVENT, b"data: [DONE]", b""]
    assert held[0].status_code == 500
    assert held[0].content == ENGINE_DEAD_EVENT[6:].replace(b", ", b",").replace(b": ", b":")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert proc.poll() is None
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("sim did not start")


# -- script mode and reasoning ------------------------------------------------------------------


async def test_chars_chunking_splits_tags_and_concatenates_to_the_script() -> None:
    with serve(SimConfig(mode="script", script=SCRIPT, script_chunking="chars")) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            req = {"messages": user("x"), "stream": True}
            chunks = sse_events((await client.post("/v1/chat/completions", json=req)).content)
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
    assert "".join(pieces) == SCRIPT
    assert all(1 <= len(p) <= 3 for p in pieces)
    assert "<think>" not in pieces


async def test_qwen3_reasoning_split(reasoner_url: str) -> None:
    async with httpx.AsyncClient(base_url=reasoner_url) as client:
        body = (await client.post("/v1/chat/completions", json={"messages": user("q")})).json()
        message = body["choices"][0]["message"]
        assert message["reasoning"] == "Let me think.\nStep two."
        assert message["content"] == "\n\nThe answer is 42."
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        req = {"messages": user("q"), "stream": True, "stream_options": {"include_usage": True}}
        chunks = sse_events((await client.post("/v1/chat/completions", json=req)).content)
        deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
        reasoning = "".join(d.get("reasoning", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        assert (reasoning, content) == (message["reasoning"], message["content"])
        last_reasoning = max(i for i, d in enumerate(deltas) if "reasoning" in d)
        assert all("reasoning" not in d for d in deltas[last_reasoning + 1 :])
        assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        off = {"messages": user("q"), "chat_template_kwargs": {"enable_thinking": False}}
        plain = (await client.post("/v1/chat/completions", json=off)).json()
        assert plain["choices"][0]["message"]["reasoning"] is None
        assert plain["choices"][0]["message"]["content"] == SCRIPT.replace("</think>", "")


def test_splitter_without_end_tag_is_all_reasoning() -> None:
    assert split_all(["<think>", "half a thou", "ght"], True) == ("half a thought", None, 3)
    assert split_all(["a</think>b</think>c"], True) == ("a", "bc", 1)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="<>/thinkab \n", max_size=40), seed=st.integers(0, 1000))
def test_streamed_split_equals_whole_split(text: str, seed: int) -> None:
    pieces = chunk_chars(text, random.Random(seed))
    splitter = Qwen3Splitter(True)
    streamed = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    reasoning = "".join(r for r, _ in streamed) or None
    content = "".join(c for _, c in streamed) or None
    assert (reasoning, content) == split_all([text], True)[:2]


# -- tokenizer, metrics -------------------------------------------------------------------------


async def test_tokenize_counts_the_chat_template(http: httpx.AsyncClient) -> None:
    req = {"messages": user("héllo wörld, 你好!"), "return_token_strs": True}
    body = (await http.post("/tokenize", json=req)).json()
    assert body["token_strs"][:2] == ["<|im_start|>", "user"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    text = "".join(body["token_strs"])
    assert body["count"] <= len(text.encode())
    back = (await http.post("/detokenize", json={"tokens": body["tokens"]})).json()
    assert back["prompt"] == text
    plain = (await http.post("/tokenize", json={"prompt": "abcdefghij"})).json()
    assert plain["count"] == 3 and plain["token_strs"] is None


async def test_metrics_exposition(http: httpx.AsyncClient) -> None:
    await http.post("/v1/chat/completions", json={"messages": user("same prefix " * 20)})
    await http.post("/v1/chat/completions", json={"messages": user("same prefix " * 20)})
    resp = await http.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert resp.headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
    text = resp.text
    assert (
        "# HELP vllm:prompt_tokens_created Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_created gauge\n"
        'vllm:prompt_tokens_created{engine="0",model_name="sim-model"} '
    ) in text
    assert 'finished_reason="repetition"' in text
    for name in (
        "vllm:kv_cache_usage_perc{",
        "vllm:prompt_tokens_total{",
        "vllm:generation_tokens_total{",
        "vllm:e2e_request_latency_seconds_bucket{",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="sim-model"}',
        "vllm:prefix_cache_queries_total{",
    ):
        assert name in text
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].rsplit(" ", 1)[1]) > 0
    assert 'vllm:request_success_total{engine="0",finished_reason="stop"' in text


async def test_token_ids_are_returned_as_vllm_returns_them_and_read_by_any_simulator(
    http: httpx.AsyncClient,
) -> None:
    """``return_token_ids``: the prompt's ids in the first chunk, a step's in each; another
    simulator (another tokenizer) reads them back, so a migrated stream's ids go on anywhere."""
    req = {"messages": user("hello there"), "max_tokens": 4, "stream": True,
           "return_token_ids": True}  # fmt: skip
    async with http.stream("POST", "/v1/chat/completions", json=req) as r:
        raw = b"".join([part async for part in r.aiter_raw()])
    chunks = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    prompt = chunks[0]["prompt_token_ids"]
    steps = [c["choices"][0]["token_ids"] for c in chunks[1:] if c["choices"]]
    assert [len(ids) for ids in steps] == [1, 1, 1, 1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:])
    other = Tokenizer()  # a fresh vocabulary: what another simulator knows
    assert other.decode(prompt) == render_chat(user("hello there"), True, False)
    assert other.decode([i for ids in steps for i in ids]) == text
    assert all(t < 2**53 for t in prompt + [i for ids in steps for i in ids])
    plain = {**req, "return_token_ids": False}
    async with http.stream("POST", "/v1/chat/completions", json=plain) as r:
        raw = b"".join([part async for part in r.aiter_raw()])
    assert b'"prompt_token_ids":null' in raw and b'"token_ids":[' not in raw
