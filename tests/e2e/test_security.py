"""Keys, per-key limits and hostile input, through a real `gpupool serve` process."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.fault_tools import wait_until
from tests.support.procs import gateway, redis_server, running, sim

MODEL = "m"
ADMIN, ALICE, BOB, LIMITED, SLOW = "sk-admin-1", "sk-alice-1", "sk-bob-1", "sk-lim-1", "sk-slow-1"
TOKENS = "sk-tpm-1"


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cfg(worker_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "aliases": ["alias"], "limits": {"image": 2},
                    "remote_media": "allow", "max_media_bytes": 1000}],
        "workers": [{"name": "w", "model": MODEL, "url": worker_url, "max_inflight": 8}],
        "auth": {
            "enabled": True,
            "admin_key_sha256": _h(ADMIN),
            "metrics_open": False,
            "keys": [
                {"name": "alice", "sha256": _h(ALICE), "tenant": "team-a"},
                {"name": "bob", "sha256": _h(BOB), "models": ["other-model"]},
                {"name": "limited", "sha256": _h(LIMITED), "rpm": 3},
                {"name": "slow", "sha256": _h(SLOW), "max_concurrent": 1},
                {"name": "tokens", "sha256": _h(TOKENS), "tpm": 40},
            ],
        },
        **extra,
    }  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("sec")
    w = sim(model=MODEL, tmp=tmp, max_num_seqs=16, mode="echo")
    g = gateway(_cfg(w.url), tmp)
    with running(w), running(g):
        httpx.get(g.url + "/health")
        yield g.url


def _chat(url: str, key: str | None, **body: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(url + "/v1/chat/completions", json={**payload, **body}, headers=headers,
                      timeout=30)  # fmt: skip


def test_missing_or_wrong_key_is_401(gw: str) -> None:
    for key in (None, "sk-wrong"):
        r = _chat(gw, key)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "AuthenticationError"
        assert "sk-wrong" not in r.text


def test_client_key_works_with_bearer_and_x_api_key(gw: str) -> None:
    assert _chat(gw, ALICE).status_code == 200
    r = httpx.post(gw + "/v1/completions", headers={"x-api-key": ALICE},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200
    client = openai.OpenAI(base_url=gw + "/v1", api_key=ALICE, max_retries=0)
    assert client.models.list().data


def test_admin_routes_need_the_admin_key(gw: str) -> None:
    assert httpx.get(gw + "/admin/workers").status_code == 401
    r = httpx.get(gw + "/admin/workers", headers={"authorization": f"Bearer {ALICE}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
    r = httpx.get(gw + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["data"][0]["name"] == "w"


def test_health_open_metrics_keyed_by_config(gw: str) -> None:
    assert httpx.get(gw + "/health").status_code == 200
    assert httpx.get(gw + "/metrics").status_code == 401
    assert httpx.get(gw + "/metrics", headers={"x-api-key": ALICE}).status_code == 200


def test_key_limited_to_models_gets_403(gw: str) -> None:
    r = _chat(gw, BOB)
    assert r.status_code == 403
    assert "may not use model" in r.json()["error"]["message"]


def test_requests_per_minute_limit_gives_429_with_retry_after(gw: str) -> None:
    codes = [_chat(gw, LIMITED).status_code for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
    r = _chat(gw, LIMITED)
    assert r.json()["error"]["type"] == "RateLimitError"
    assert 1 <= int(r.headers["retry-after"]) <= 60


def test_concurrency_limit(gw: str) -> None:
    async def two() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": MODEL, "prompt": "x " * 50, "max_tokens": 200, "stream": True}
            h = {"authorization": f"Bearer {SLOW}", "x-sim-hold-ms": "1500"}
            async with c.stream("POST", gw + "/v1/completions", json=body, headers=h) as first:
                second = await c.post(gw + "/v1/completions", json=body, headers=h)
                return [first.status_code, second.status_code]

    assert asyncio.run(two()) == [200, 429]
    # released once the gateway has seen the client go (a moment later under load: in make
    # check at 93b208e the next request came first and got the 429); a leaked slot never is
    wait_until("SLOW's slot given back", lambda: _chat(gw, SLOW).status_code == 200, 15)


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _media_chat(gw: str, parts: list[dict[str, Any]]) -> httpx.Response:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]
    return _chat(gw, ALICE, messages=msgs)


def test_too_many_images_rejected_with_vllm_message(gw: str) -> None:
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"0" * 10).decode()
    r = _media_chat(gw, [_image(png)] * 3)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("At most 2 image(s) may be provided in one")


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "http://127.0.0.1:6379/x.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/x.png",
        "http://10.0.0.1/x.png",
        "http://localhost/x.png",
        "data:image/png;base64," + "A" * 4000,  # over max_media_bytes (1000)
    ],
)
def test_dangerous_media_urls_refused(gw: str, url: str) -> None:
    r = _media_chat(gw, [_image(url)])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400


def test_json_escaped_media_parts_are_still_checked(gw: str) -> None:
    raw = (
        b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":['
        b'{"type":"\\u0069mage_url","image_url":{"url":"file:///etc/passwd"}}]}]}'
    )
    r = httpx.post(gw + "/v1/chat/completions", content=raw,
                   headers={"authorization": f"Bearer {ALICE}",
                            "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400


def test_body_too_large_is_413(gw: str) -> None:
    big = b'{"model":"m","prompt":"' + b"x" * (33 * 1024 * 1024) + b'"}'
    r = httpx.post(gw + "/v1/completions", content=big,
                   headers={"authorization": f"Bearer {ALICE}"}, timeout=60)  # fmt: skip
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_rate_limits_shared_across_replicas_through_redis(tmp_path: Path) -> None:
    redis = redis_server(tmp_path)
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=16)
    with running(redis), running(w):
        q = {"backend": "redis", "redis_url": redis.url}
        a, b = gateway(_cfg(w.url, queue=q), tmp_path), gateway(_cfg(w.url, queue=q), tmp_path)
        with running(a, b):
            codes = [_chat(url, LIMITED).status_code for url in (a.url, b.url, a.url, b.url)]
            assert codes == [200, 200, 200, 429]


def test_oversized_headers_get_431(gw: str) -> None:
    r = httpx.get(gw + "/health", headers={"x-big": "a" * 100_000})
    assert r.status_code == 431


def test_slowloris_connection_is_closed(tmp_path: Path) -> None:
    import socket
    import time

    w = sim(model=MODEL, tmp=tmp_path)
    g = gateway(_cfg(w.url, server={"header_timeout_s": 1.0}), tmp_path)
    with running(w), running(g):
        host, port = g.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes the head
            s.settimeout(20)
            t0 = time.monotonic()
            assert s.recv(100) == b""  # the gateway closed it
            # the 1-s head deadline plus a loaded machine's slack, far short of the 30-s keep-alive
            assert time.monotonic() - t0 < 10
        with socket.create_connection((host, int(port))) as s:  # a keep-alive connection
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(20)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next head never finishes
            t0 = time.monotonic()
            assert s.recv(100) == b""  # closed by the head deadline, not the 30 s keep-alive
            assert time.monotonic() - t0 < 10
        assert httpx.get(g.url + "/health").status_code == 200


def test_tokens_per_minute_counted_from_usage(gw: str) -> None:
    codes = []
    for stream in (False, True, False, True, False, True):
        body = {
            "model": MODEL,
            "prompt": "one two three four five",
            "max_tokens": 8,
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
        }
        r = httpx.post(gw + "/v1/completions", json=body,
                       headers={"authorization": f"Bearer {TOKENS}"})  # fmt: skip
        codes.append(r.status_code)
        if r.status_code == 429:
            assert "tokens per minute" in r.json()["error"]["message"]
            break
    assert codes[0] == 200 and codes[-1] == 429, codes
