"""Tenancy through a real `gpupool serve`, against two recording workers of one model.

What a worker receives (its request id, headers, ``cache_salt``) and where a stored response's
later uses go (``previous_response_id``, ``GET``/``DELETE``/``cancel``/``input_items``), for
three keys of two tenants: team-a (two keys) and t1.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import RedisServer
from tests.gateway.tenancy.fake_worker import FakeWorker
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import gateway, running

MODEL = "m"
A1, A2, B, ADMIN = "sk-a1-e2e", "sk-a2-e2e", "sk-b-e2e", "sk-admin-e2e"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _auth() -> dict[str, Any]:
    return {"enabled": True, "admin_key_sha256": _h(ADMIN),
            "keys": [{"name": "a1", "sha256": _h(A1), "tenant": "team-a"},
                     {"name": "a2", "sha256": _h(A2), "tenant": "team-a"},
                     {"name": "b", "sha256": _h(B), "tenant": "t1"}]}  # fmt: skip


def cfg(w1: str, w2: str, **extra: Any) -> dict[str, Any]:
    return {"server": {"expose_worker_header": True}, "models": [{"name": MODEL}],
            "workers": [{"name": "w1", "model": MODEL, "url": w1},
                        {"name": "w2", "model": MODEL, "url": w2}],
            "routing": {"health_interval_s": 0.5}, "auth": _auth(), **extra}  # fmt: skip


@dataclass
class Pool:
    gw: str
    w1: FakeWorker
    w2: FakeWorker

    def seen(self) -> list[Any]:
        return sorted(self.w1.requests() + self.w2.requests(), key=lambda s: s.at)

    def clear(self) -> None:
        self.w1.seen.clear()
        self.w2.seen.clear()

    def worker(self, name: str) -> FakeWorker:
        return self.w1 if name == "w1" else self.w2


def wait_ready(url: str) -> None:
    for _ in range(300):
        if httpx.get(url + "/ready", headers=ADMIN_H, timeout=5).status_code == 200:
            return
        asyncio.run(asyncio.sleep(0.1))
    raise TimeoutError("workers not ready")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("tenancy")
    w1, w2 = FakeWorker(MODEL), FakeWorker(MODEL)
    with w1.running(), w2.running():
        g = gateway(cfg(w1.url, w2.url), tmp)
        with running(g):
            wait_ready(g.url)
            yield Pool(g.url, w1, w2)


@pytest.fixture(autouse=True)
def _clean(pool: Pool) -> Iterator[None]:
    pool.clear()
    yield
    assert_nothing_held(pool.gw, ADMIN_H)


def _k(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _post(pool: Pool, path: str, key: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(pool.gw + path, json=body, headers={**_k(key), **headers}, timeout=30)


# ---- request ids and headers -----------------------------------------------------------------


def test_a_worker_sees_the_gateways_own_request_id_never_the_clients(pool: Pool) -> None:
    """Three tenants send the same x-request-id at once: three distinct ids reach the workers
    (before: the client's, three times); each client gets its own id back."""

    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as c:
            return list(await asyncio.gather(*(
                c.post(pool.gw + "/v1/completions", headers={**_k(k), "x-request-id": "same"},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                for k in (A1, A2, B))))  # fmt: skip

    replies = asyncio.run(three())
    assert [r.status_code for r in replies] == [200] * 3
    assert all(r.headers["x-request-id"] == "same" for r in replies)
    ids = [s.headers["x-request-id"] for s in pool.seen()]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_hop_by_hop_forwarding_and_gateway_headers_never_reach_a_worker(pool: Pool) -> None:
    sent = {
        "connection": "keep-alive, x-hop-named",
        "x-hop-named": "1",
        "keep-alive": "timeout=5",
        "te": "trailers",
        "x-forwarded-for": "10.9.8.7",
        "x-forwarded-host": "evil",
        "forwarded": "for=10.9.8.7",
        "x-real-ip": "10.9.8.7",
        "via": "1.1 evil",
        "x-gpupool-worker": "w2",
        "x-gpupool-tenant": "t1",
        "x-vllm-priority": "-1000000",
        "x-vllm-anything": "1",
        "x-data-parallel-rank": "1",
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=1",
        "x-custom": "kept",
    }
    r = _post(pool, "/v1/completions", A1, {"model": MODEL, "prompt": "hi", "max_tokens": 1},
              **sent)  # fmt: skip
    assert r.status_code == 200, r.text
    (got,) = pool.seen()
    passed = {k for k in sent if k in got.headers}
    assert passed == {"traceparent", "tracestate", "x-custom"}, got.headers
    assert got.headers["traceparent"] == TRACEPARENT


def test_a_malformed_traceparent_is_dropped_with_its_tracestate(pool: Pool) -> None:
    r = _post(pool, "/v1/completions", A1, {"model": MODEL, "prompt": "hi", "max_tokens": 1},
              traceparent="00-xyz-01", tracestate="vendor=1")  # fmt: skip
    assert r.status_code == 200
    (got,) = pool.seen()
    assert "traceparent" not in got.headers and "tracestate" not in got.headers


# ---- cache salts -----------------------------------------------------------------------------

_SALTED = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/embeddings", {"input": "hi"}),
]


@pytest.mark.parametrize(("path", "body"), _SALTED)
def test_each_tenant_gets_its_own_cache_salt_on_every_route(
    pool: Pool, path: str, body: dict[str, Any]
) -> None:
    salts = {}
    for key in (A1, A2, B):
        r = _post(pool, path, key, {"model": MODEL, **body})
        assert r.status_code == 200, r.text
        salts[key] = pool.seen()[-1].body["cache_salt"]
    assert salts[A1] == salts[A2] != salts[B]
    for salt in salts.values():  # a keyed hash: no tenant name, vLLM's character rules
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", salt)
        assert "team" not in salt and "t1" not in salt


def test_routes_without_a_cache_get_no_salt(pool: Pool) -> None:
    r = _post(pool, "/tokenize", A1, {"model": MODEL, "prompt": "hi"})
    assert r.status_code == 200
    assert all("cache_salt" not in s.body for s in pool.w1.seen + pool.w2.seen)


def test_v2_embed_is_sent_as_is_since_vllm_drops_a_salt_there(pool: Pool) -> None:
    """vLLM's Cohere request (`CohereEmbedRequest`) has no `cache_salt` and ignores unknown
    fields: the gateway sets none there (docs/reference/vllm-differences.md)."""
    for key, extra in ((A1, {}), (B, {"cache_salt": "mine"})):
        r = _post(pool, "/v2/embed", key, {"model": MODEL, "texts": ["hi"], **extra})
        assert r.status_code == 200, r.text
        assert pool.seen()[-1].path == "/v2/embed"
        assert pool.seen()[-1].body.get("cache_salt") == extra.get("cache_salt")


def test_a_client_salt_is_mixed_into_its_tenants_and_checked(pool: Pool) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    mine = []
    for key, salt in ((A1, None), (A1, "u1"), (A2, "u1"), (B, "u1")):
        extra = {} if salt is None else {"cache_salt": salt}
        assert _post(pool, "/v1/completions", key, {**body, **extra}).status_code == 200
        mine.append(pool.seen()[-1].body["cache_salt"])
    plain, a1, a2, b = mine
    assert a1 == a2  # one tenant, one client salt: one cache
    assert len({plain, a1, b}) == 3  # never the client's own, never another tenant's
    for bad in ("a/b", "", "x" * 129, 5):
        r = _post(pool, "/v1/completions", A1, {**body, "cache_salt": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt"


# ---- stored responses ----------------------------------------------------------------------


def _client(pool: Pool, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.gw + "/v1", api_key=key, max_retries=0, timeout=30)


def test_follow_ups_and_reads_of_a_stored_response_go_to_its_worker(pool: Pool) -> None:
    a = _client(pool, A1)
    first = a.responses.with_raw_response.create(model=MODEL, input="hello")
    home = first.headers["x-gpupool-worker"]
    made = first.parse()
    assert re.fullmatch(r"resp_[0-9a-f]{32}", made.id)
    assert made.id in pool.worker(home).responses  # vLLM names it by the body's request_id
    for i in range(10):
        r = a.responses.with_raw_response.create(model=MODEL, input=f"more {i}",
                                                 previous_response_id=made.id)  # fmt: skip
        assert r.headers["x-gpupool-worker"] == home
    got = httpx.get(f"{pool.gw}/v1/responses/{made.id}?stream=false&starting_after=2",
                    headers=_k(A2), timeout=30)  # fmt: skip
    assert got.status_code == 200 and got.headers["x-gpupool-worker"] == home
    assert pool.worker(home).seen[-1].query == "stream=false&starting_after=2"
    assert a.responses.cancel(made.id).status == "cancelled"
    assert a.responses.input_items.list(made.id).data == []
    assert {(s.method, s.path.rsplit("/", 1)[-1]) for s in pool.worker(home).seen[-3:]} == {
        ("GET", made.id), ("POST", "cancel"), ("GET", "input_items")}  # fmt: skip
    a.responses.delete(made.id)
    before = len(pool.seen())
    with pytest.raises(openai.NotFoundError):  # forgotten: the gateway answers, not a worker
        a.responses.retrieve(made.id)
    assert len(pool.seen()) == before


def test_a_stored_response_streams_from_its_worker(pool: Pool) -> None:
    """`GET /v1/responses/{id}?stream=true` (polling a background response by its events)
    is relayed from the worker that stored it, event by event."""
    raw = _client(pool, A1).responses.with_raw_response.create(model=MODEL, input="x")
    home, made = raw.headers["x-gpupool-worker"], raw.parse()
    url = f"{pool.gw}/v1/responses/{made.id}?stream=true&starting_after=0"
    with httpx.stream("GET", url, headers=_k(A1), timeout=30) as r:
        assert r.status_code == 200 and r.headers["x-gpupool-worker"] == home
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().split(b"\n\n") if e]
    assert [e.split(b"\n")[0] for e in events] == [b"event: response.created",
                                                   b"event: response.completed"]  # fmt: skip
    with httpx.stream("GET", url, headers=_k(B), timeout=30) as r:
        assert r.status_code == 404


def _tokens(pool: Pool) -> float:
    """Every token the gateway counted (``gpupool_tokens_total``, all kinds and workers)."""
    text = httpx.get(pool.gw + "/metrics", headers=ADMIN_H, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gpupool_tokens_total{"))  # fmt: skip


def test_reading_a_stored_response_counts_its_tokens_no_more(pool: Pool) -> None:
    """A stored response's usage was counted when it was made: reading it back (whole, by its
    events, its input items) counts no tokens again, as it charges its key none."""
    made = _client(pool, A1).responses.create(model=MODEL, input="count me once")
    before = _tokens(pool)
    assert before >= 4  # its 3 + 1, among the module's earlier requests
    got = httpx.get(f"{pool.gw}/v1/responses/{made.id}", headers=_k(A1), timeout=30)
    assert got.status_code == 200 and got.json()["usage"]["input_tokens"] == 3
    url = f"{pool.gw}/v1/responses/{made.id}?stream=true&starting_after=0"
    with httpx.stream("GET", url, headers=_k(A1), timeout=30) as r:
        assert r.status_code == 200 and b"response.completed" in r.read()
    assert _client(pool, A1).responses.input_items.list(made.id).data == []
    assert _tokens(pool) == before


def test_another_tenant_never_reaches_a_stored_response(pool: Pool) -> None:
    made = _client(pool, A1).responses.create(model=MODEL, input="secret")
    b = _client(pool, B)
    pool.clear()
    for attempt in (
        lambda: b.responses.retrieve(made.id),
        lambda: b.responses.cancel(made.id),
        lambda: b.responses.delete(made.id),
        lambda: b.responses.input_items.list(made.id),
        lambda: b.responses.create(model=MODEL, input="x", previous_response_id=made.id),
        lambda: b.responses.retrieve("resp_" + "0" * 32),  # an id nobody made
    ):
        with pytest.raises(openai.NotFoundError) as e:
            attempt()
        body = e.value.response.json()["error"]
        assert body["message"].startswith("Response with id '") and body["code"] == 404
        assert body["type"] == "invalid_request_error" and body["param"] == "response_id"
    assert pool.seen() == []  # no worker heard of any of it


def test_a_response_made_with_store_false_is_not_remembered(pool: Pool) -> None:
    made = _client(pool, A1).responses.create(model=MODEL, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        _client(pool, A1).responses.retrieve(made.id)


def test_the_client_request_id_never_names_a_response(pool: Pool) -> None:
    """vLLM makes the body's `request_id` the response's id: a client choosing it could take
    another tenant's id on the worker. The gateway names every response itself."""
    r = _post(pool, "/v1/responses", A1, {"model": MODEL, "input": "x", "request_id": "resp_x"})
    assert r.status_code == 200
    assert r.json()["id"] != "resp_x" and pool.seen()[-1].body["request_id"] == r.json()["id"]


def test_a_response_whose_worker_is_gone_is_a_plain_404(pool: Pool) -> None:
    a = _client(pool, A1)
    raw = a.responses.with_raw_response.create(model=MODEL, input="x")
    home, made = raw.headers["x-gpupool-worker"], raw.parse()
    assert httpx.post(f"{pool.gw}/admin/workers/{home}/drain", headers=ADMIN_H,
                      timeout=30).status_code == 200  # fmt: skip
    attempts: list[Callable[[], object]] = [
        lambda: a.responses.retrieve(made.id),
        lambda: a.responses.create(model=MODEL, input="y", previous_response_id=made.id),
    ]
    try:
        for attempt in attempts:
            with pytest.raises(openai.NotFoundError) as e:
                attempt()
            assert "no longer serving" in e.value.response.json()["error"]["message"]
    finally:
        httpx.post(f"{pool.gw}/admin/workers/{home}/undrain", headers=ADMIN_H, timeout=30)
        wait_ready(pool.gw)


def test_a_stored_response_route_takes_only_its_methods(pool: Pool) -> None:
    r = httpx.put(pool.gw + "/v1/responses/resp_x", headers=_k(A1), timeout=10)
    assert r.status_code == 405
    r = httpx.get(pool.gw + "/v1/responses/resp_x", timeout=10)
    assert r.status_code == 401


def test_a_reload_that_adds_a_tenant_isolates_caches(tmp_path: Path) -> None:
    """`tenancy.cache: auto` decides again on reload: one tenant, no salt (vLLM's bytes as
    sent); a second tenant's key reloaded in, salts from the next request."""
    w = FakeWorker(MODEL)
    one = {**_auth(), "keys": _auth()["keys"][:2]}  # team-a only
    with w.running():
        g = gateway(
            {
                "models": [{"name": MODEL}],
                "auth": one,
                "workers": [{"name": "w1", "model": MODEL, "url": w.url}],
            },
            tmp_path,
        )
        path = Path(g.argv[g.argv.index("--config") + 1])
        with running(g):
            wait_ready(g.url)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            r = httpx.post(g.url + "/v1/completions", json=body, headers=_k(A1), timeout=30)
            assert r.status_code == 200 and "cache_salt" not in w.seen[-1].body
            cfg_now = yaml.safe_load(path.read_text())
            cfg_now["auth"] = _auth()
            path.write_text(yaml.safe_dump(cfg_now))
            r = httpx.post(g.url + "/admin/reload", headers=ADMIN_H, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(g.url + "/v1/completions", json=body, headers=_k(A1), timeout=30)
            assert r.status_code == 200 and "cache_salt" in w.seen[-1].body


def test_replicas_sharing_redis_send_a_follow_up_to_its_worker(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """With `queue.backend: redis`, a response made through one gateway is found by another:
    its follow-ups and reads reach the worker that stored it, and another tenant still gets
    the 404."""
    w1, w2 = FakeWorker(MODEL), FakeWorker(MODEL)
    with w1.running(), w2.running():
        queue = {"backend": "redis", "redis_url": own_redis.url}
        one = gateway(cfg(w1.url, w2.url, queue=queue), tmp_path)
        (tmp_path / "two").mkdir()
        two = gateway(cfg(w1.url, w2.url, queue=queue), tmp_path / "two")
        with running(one, two):
            wait_ready(one.url)
            wait_ready(two.url)
            pool = Pool(one.url, w1, w2)
            raw = _client(pool, A1).responses.with_raw_response.create(model=MODEL, input="x")
            home, made = raw.headers["x-gpupool-worker"], raw.parse()
            other = Pool(two.url, w1, w2)
            for i in range(6):
                r = _client(other, A2).responses.with_raw_response.create(
                    model=MODEL, input=f"y{i}", previous_response_id=made.id)  # fmt: skip
                assert r.headers["x-gpupool-worker"] == home
            assert _client(other, A1).responses.retrieve(made.id).id == made.id
            with pytest.raises(openai.NotFoundError):
                _client(other, B).responses.retrieve(made.id)
