"""The simulator's contract: the same requests to `gpupool sim` and to a real vLLM 0.32 (CPU)
give the same statuses, JSON keys, error types and SSE framing. Values (text, ids, times) may
differ; shapes may not."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.procs import Proc
from tests.vllm.conftest import BIG_WINDOW, MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 5}
TOO_LONG = {"model": MODEL, "prompt": "alpha beta " * 3000, "max_tokens": 5}

CASES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("chat", "/v1/chat/completions", CHAT),
    ("chat n=2", "/v1/chat/completions", {**CHAT, "n": 2}),
    ("completion", "/v1/completions", COMPLETION),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "nope"}),
    ("too long", "/v1/completions", TOO_LONG),
    ("max_tokens too big", "/v1/completions", {**COMPLETION, "max_tokens": BIG_WINDOW + 1}),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "x"}),
    ("stream_options without stream", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}),
    ("tokenize prompt", "/tokenize", {"model": MODEL, "prompt": "hello there"}),
    ("tokenize messages", "/tokenize", {"model": MODEL, "messages": CHAT["messages"]}),
]  # fmt: skip


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


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
def test_same_status_and_shape(
    targets: tuple[str, str], name: str, path: str, body: dict[str, Any]
) -> None:
    real, fake = (_post(base, path, body or {}) for base in targets)
    assert real.status_code == fake.status_code, (real.text[:500], fake.text[:500])
    rj, fj = real.json(), fake.json()
    if real.status_code >= 400:
        assert set(rj) == set(fj) == {"error"}
        assert set(rj["error"]) == set(fj["error"])
        assert rj["error"]["type"] == fj["error"]["type"]
        assert rj["error"]["param"] == fj["error"]["param"]
        return
    assert _loose(_shape(rj)) == _loose(_shape(fj))


def _loose(shape: Any) -> Any:
    """Leaves that are null in one server and set in the other are compared as 'any'."""
    if isinstance(shape, dict):
        return {k: _loose(v) for k, v in shape.items()}
    if isinstance(shape, list):
        return [_loose(v) for v in shape]
    return "leaf"


def _events(base: str, path: str, body: dict[str, Any]) -> list[bytes]:
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"data: [DONE]\n\n")
    return [e for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_same_stream_framing(targets: tuple[str, str], path: str) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    real, fake = (_events(base, path, body) for base in targets)
    for events in (real, fake):
        assert all(e.startswith(b"data: ") for e in events)
        assert events[-1] == b"data: [DONE]"
    r_json = [orjson.loads(e[6:]) for e in real[:-1]]
    f_json = [orjson.loads(e[6:]) for e in fake[:-1]]
    assert _loose(_shape(r_json[0])) == _loose(_shape(f_json[0]))  # first (role) chunk
    assert _loose(_shape(r_json[-1])) == _loose(_shape(f_json[-1]))  # usage chunk
    assert r_json[-1]["choices"] == f_json[-1]["choices"] == []
    assert set(r_json[-1]["usage"]) == set(f_json[-1]["usage"])


def test_same_models_card_and_metric_names(targets: tuple[str, str]) -> None:
    real, fake = (httpx.get(b + "/v1/models").json() for b in targets)
    assert _loose(_shape(real)) == _loose(_shape(fake))
    assert real["data"][0]["max_model_len"] == fake["data"][0]["max_model_len"] == BIG_WINDOW
    wanted = ["vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
              "vllm:request_success_total"]  # fmt: skip
    for b in targets:
        text = httpx.get(b + "/metrics").text
        for name in wanted:
            assert f"\n{name}{{" in text, (b, name)
    assert httpx.get(targets[0] + "/health").content == httpx.get(targets[1] + "/health").content
