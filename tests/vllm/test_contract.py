"""The simulator's contract: the same requests to `gpupool sim` and to a real vLLM 0.32 (CPU)
give the same statuses, headers, JSON keys, error bodies and SSE framing. Values that depend on
the model (text, ids, token counts, times, the fingerprint's hash) may differ; shapes may not."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson
import pytest

from gpupool.workers.probe import FILTERED_METRICS, parse_load
from tests.support.procs import Proc
from tests.vllm.conftest import BIG_WINDOW, MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 5}
TOO_LONG = {"model": MODEL, "prompt": "alpha beta " * 3000, "max_tokens": 5}
# greedy: sampled at vLLM's default temperature the random-weight model's five tokens depend on what
# the worker served before (its sampler's state), and some draws decode to no text at all (no
# content block: seen once test_same_token_ids_in_a_stream ran before it)
MESSAGES = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 5,
    "temperature": 0,
}
BUDGET = {**MESSAGES, "max_tokens": 1030, "thinking": {"type": "enabled", "budget_tokens": 1024}}
FILLS_WINDOW = {"model": MODEL, "prompt": [100] * BIG_WINDOW}  # max_tokens is clamped to 0
FINGERPRINT = re.compile(r"vllm-0\.32\.0-[0-9a-f]{8}")
SSE_TYPE = "text/event-stream; charset=utf-8"

CASES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("chat", "/v1/chat/completions", CHAT),
    ("chat n=2", "/v1/chat/completions", {**CHAT, "n": 2}),
    ("completion", "/v1/completions", COMPLETION),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "nope"}),
    ("unknown model stream", "/v1/chat/completions", {**CHAT, "model": "nope", "stream": True}),
    ("too long", "/v1/completions", TOO_LONG),
    ("too long stream", "/v1/completions", {**TOO_LONG, "stream": True}),
    ("prompt fills window", "/v1/completions", FILLS_WINDOW),
    ("prompt fills window stream", "/v1/completions", {**FILLS_WINDOW, "stream": True}),
    ("max_tokens too big", "/v1/completions", {**COMPLETION, "max_tokens": BIG_WINDOW + 1}),
    ("max_tokens -1", "/v1/chat/completions", {**CHAT, "max_tokens": -1}),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "x"}),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}),
    ("stream_options without stream", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}),
    ("stream_options without stream, completions", "/v1/completions",
     {**COMPLETION, "stream_options": {"include_usage": True}}),
    ("tokenize prompt", "/tokenize", {"model": MODEL, "prompt": "hello there"}),
    ("tokenize messages", "/tokenize", {"model": MODEL, "messages": CHAT["messages"]}),
    ("tokenize unknown model", "/tokenize", {"model": "nope", "prompt": "x"}),
    # vLLM's Anthropic adapter (issue 35: the simulator serves it too)
    ("messages", "/v1/messages", MESSAGES),
    ("messages unknown model", "/v1/messages", {**MESSAGES, "model": "nope"}),
    ("messages budget without a reasoning config", "/v1/messages", BUDGET),
    ("count_tokens", "/v1/messages/count_tokens",
     {"model": MODEL, "messages": MESSAGES["messages"]}),
]  # fmt: skip
# Raw bodies and content types that never reach the schema.
RAW_CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("no content type", orjson.dumps(CHAT), {}),
    ("text/plain", orjson.dumps(CHAT), {"content-type": "text/plain"}),
    ("empty body", b"", {"content-type": "application/json"}),
    ("truncated JSON", orjson.dumps(CHAT)[:-9], {"content-type": "application/json"}),
    ("missing colon", b'{"model" "tiny"}', {"content-type": "application/json"}),
    ("not UTF-8", b'{"model": "\xff"}', {"content-type": "application/json"}),
]


@pytest.fixture(scope="module")
def targets(real_stack: dict[str, Any], contract_sim: Proc) -> tuple[str, str]:
    big = httpx.get(real_stack["gw"].url + "/admin/workers/big").json()
    return big["url"], contract_sim.url


def _shape(obj: Any) -> Any:
    """Keys all the way down (lists by their first element), and the types of leaves."""
    if isinstance(obj, dict):
        return {k: _shape(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_shape(obj[0])] if obj else []
    return type(obj).__name__ if obj is not None else None


def _loose(shape: Any) -> Any:
    """Leaves that are null in one server and set in the other are compared as 'any'."""
    if isinstance(shape, dict):
        return {k: _loose(v) for k, v in shape.items()}
    if isinstance(shape, list):
        return [_loose(v) for v in shape]
    return "leaf"


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def _headers(resp: httpx.Response) -> dict[str, str]:
    """The headers a client may look at (not date, length or encoding)."""
    drop = {"date", "content-length", "transfer-encoding"}
    return {k: v for k, v in resp.headers.items() if k not in drop}


# A raw prompt is refused above max_model_len x the tokenizer's longest token string: 13 for
# the tiny model, 12 for the simulator's tokenizer. That factor belongs to the model.
CHAR_BOUND = re.compile(rb"more than (\d+) characters, which is the upper bound")


def _same_error(real: httpx.Response, fake: httpx.Response) -> None:
    """Errors are deterministic: the same status, headers and body, byte for byte (but for the
    tokenizer-dependent character bound)."""
    assert real.status_code == fake.status_code, (real.text[:500], fake.text[:500])
    assert _headers(real) == _headers(fake)
    bounds = [CHAR_BOUND.search(r.content) for r in (real, fake)]
    for found in bounds:
        assert found is None or int(found[1]) % BIG_WINDOW == 0
    r_body, f_body = (CHAR_BOUND.sub(b"more than N characters", r.content) for r in (real, fake))
    assert r_body == f_body


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_same_status_and_shape(
    targets: tuple[str, str], name: str, path: str, body: dict[str, Any] | None
) -> None:
    real, fake = (_post(base, path, body or {}) for base in targets)
    assert real.status_code == fake.status_code, (real.text[:500], fake.text[:500])
    if real.status_code >= 400:
        _same_error(real, fake)
        return
    assert _headers(real) == _headers(fake)
    rj, fj = real.json(), fake.json()
    assert _loose(_shape(rj)) == _loose(_shape(fj))
    assert list(rj) == list(fj)  # key order too: clients that diff bodies see it
    if "choices" in rj:
        assert FINGERPRINT.fullmatch(rj["system_fingerprint"])
        assert FINGERPRINT.fullmatch(fj["system_fingerprint"])
        assert list(rj["usage"]) == list(fj["usage"])


@pytest.mark.parametrize(("name", "raw", "headers"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_same_error_for_raw_bodies(
    targets: tuple[str, str], name: str, raw: bytes, headers: dict[str, str]
) -> None:
    real, fake = (
        httpx.post(base + "/v1/chat/completions", content=raw, headers=headers, timeout=60)
        for base in targets
    )
    _same_error(real, fake)


def test_same_fastapi_errors_for_unknown_routes_and_methods(targets: tuple[str, str]) -> None:
    for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/foo"),
                         ("GET", "/v1/chat/completions")):  # fmt: skip
        real, fake = (httpx.request(method, base + path, timeout=60) for base in targets)
        _same_error(real, fake)


def _events(base: str, path: str, body: dict[str, Any]) -> tuple[list[bytes], httpx.Headers]:
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n")
    return [e for e in raw.split(b"\n\n") if e], r.headers


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_same_stream_framing(targets: tuple[str, str], path: str) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    (real, r_headers), (fake, f_headers) = (_events(base, path, body) for base in targets)
    assert r_headers["content-type"] == f_headers["content-type"] == SSE_TYPE
    assert {k: v for k, v in r_headers.items() if k != "date"} == {
        k: v for k, v in f_headers.items() if k != "date"
    }
    for events in (real, fake):
        assert all(e.startswith(b"data: ") for e in events)
        assert events[-1] == b"data: [DONE]"
    r_json = [orjson.loads(e[6:]) for e in real[:-1]]
    f_json = [orjson.loads(e[6:]) for e in fake[:-1]]
    assert _loose(_shape(r_json[0])) == _loose(_shape(f_json[0]))  # first chunk
    assert _loose(_shape(r_json[-2])) == _loose(_shape(f_json[-2]))  # finishing chunk
    assert r_json[-2]["choices"][0]["finish_reason"] == f_json[-2]["choices"][0]["finish_reason"]
    assert list(r_json[-1]) == list(f_json[-1])  # usage chunk, keys in order
    assert r_json[-1]["choices"] == f_json[-1]["choices"] == []
    assert list(r_json[-1]["usage"]) == list(f_json[-1]["usage"])
    for chunks in (r_json, f_json):
        assert FINGERPRINT.fullmatch(chunks[-1]["system_fingerprint"])
        assert all("system_fingerprint" not in c for c in chunks[:-1])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_same_token_ids_in_a_stream(targets: tuple[str, str], path: str) -> None:
    """With ``return_token_ids`` (the gateway asks it of every stream that may move): the
    prompt's ids in the first chunk (chat: at its top; completions: in its choice), each
    step's in every chunk after, every one of the answer's tokens once."""
    chat = "chat" in path
    body = {**(CHAT if chat else COMPLETION), "stream": True, "return_token_ids": True}
    (real, _), (fake, _) = (_events(base, path, body) for base in targets)
    shapes = []
    for events in (real, fake):
        chunks = [orjson.loads(e[6:]) for e in events[:-1]]
        first = chunks[0]
        prompt = first["prompt_token_ids"] if chat else first["choices"][0]["prompt_token_ids"]
        assert isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        steps = [c["choices"][0]["token_ids"] for c in chunks[1 if chat else 0 :]]
        assert all(isinstance(ids, list) for ids in steps), steps
        assert sum(len(ids) for ids in steps) == body["max_tokens"]
        if not chat:
            assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
        shapes.append([_loose(_shape(c)) for c in (chunks[0], chunks[1], chunks[-1])])
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_same_fingerprint_placement_without_usage(targets: tuple[str, str], path: str) -> None:
    """Without include_usage the fingerprint rides on the finishing chunk, after the choices."""
    body = {**(CHAT if "chat" in path else COMPLETION), "stream": True}
    (real, _), (fake, _) = (_events(base, path, body) for base in targets)
    for events in (real, fake):
        chunks = [orjson.loads(e[6:]) for e in events[:-1]]
        assert list(chunks[-1])[-1] == "system_fingerprint"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all("system_fingerprint" not in c for c in chunks[:-1])
    r_last, f_last = orjson.loads(real[-2][6:]), orjson.loads(fake[-2][6:])
    assert _loose(_shape(r_last)) == _loose(_shape(f_last))


def _anthropic_events(base: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    with httpx.stream("POST", base + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == SSE_TYPE
        raw = b"".join(r.iter_raw())
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            kind, data = block.split(b"\n", 1)
            assert kind.startswith(b"event: ") and data.startswith(b"data: ")
            out.append((kind[7:].decode(), orjson.loads(data[6:])))
    return out


def test_same_messages_stream(targets: tuple[str, str]) -> None:
    """``/v1/messages`` streamed: the same events in the same order (deltas counted once), the
    same shapes; a thinking budget without a reasoning config is the same lone error event."""
    real, fake = (_anthropic_events(b, {**MESSAGES, "stream": True}) for b in targets)
    kinds = [
        [k for i, (k, _) in enumerate(ev) if i == 0 or ev[i - 1][0] != k] for ev in (real, fake)
    ]
    assert kinds[0] == kinds[1], kinds
    for (rk, r_obj), (fk, f_obj) in zip(real, fake, strict=False):
        if rk == fk and rk != "content_block_delta":
            assert _loose(_shape(r_obj)) == _loose(_shape(f_obj)), rk
            assert list(r_obj) == list(f_obj), rk
    refused = [_anthropic_events(b, {**BUDGET, "stream": True}) for b in targets]
    assert refused[0] == refused[1]
    assert [k for k, _ in refused[0]] == ["error"]


def test_same_models_card_and_metric_names(targets: tuple[str, str]) -> None:
    real, fake = (httpx.get(b + "/v1/models").json() for b in targets)
    assert _loose(_shape(real)) == _loose(_shape(fake))
    assert real["data"][0]["max_model_len"] == fake["data"][0]["max_model_len"] == BIG_WINDOW
    wanted = ["vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
              "vllm:request_success_total", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total"]  # fmt: skip
    created = ("# HELP vllm:prompt_tokens_created Number of prefill tokens processed.\n"
               "# TYPE vllm:prompt_tokens_created gauge\n")  # fmt: skip
    types = set()
    for b in targets:
        resp = httpx.get(b + "/metrics", headers={"accept": "application/openmetrics-text"})
        types.add(resp.headers["content-type"])
        for name in wanted:
            assert f"\n{name}{{" in resp.text, (b, name)
        assert created in resp.text, b
        for reason in ("stop", "length", "abort", "error", "repetition"):
            assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}"' in resp.text
    assert types == {"text/plain; version=1.0.0; charset=utf-8"}
    real_health, fake_health = (httpx.get(b + "/health") for b in targets)
    assert real_health.content == fake_health.content == b""
    assert _headers(real_health) == _headers(fake_health)


def test_the_filtered_metrics_path_serves_the_gauges_routing_reads(
    targets: tuple[str, str],
) -> None:
    """The poller asks for three gauges only (``probe.FILTERED_METRICS``): vLLM renders just
    those; the simulator sends everything, which reads the same."""
    real, fake = (httpx.get(b + FILTERED_METRICS) for b in targets)
    for resp in (real, fake):
        assert resp.status_code == 200
        for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{",
                     "vllm:kv_cache_usage_perc{"):  # fmt: skip
            assert name in resp.text, (resp.url, name)
        assert parse_load(resp.text).kv_usage >= 0
    assert len(real.content) < 4096, len(real.content)  # not the ~50 KB of everything
