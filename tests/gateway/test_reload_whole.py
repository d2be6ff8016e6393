"""Reload means the whole config, through a real `gpupool serve`, its admin API and the openai
SDK: keys are revoked without a restart (new requests 401, queued ones refused, running streams
finished or cut as `auth.revoked_streams` says), a broken keys file refuses the whole reload
with its line named and the old keys keep working, run-time settings apply and the others are
listed as needing a restart; admin query parameters are checked like a client's.

One simulated worker with one slot (`max_inflight: 1`): a request holding it (`x-sim-hold-ms`)
makes the next one queue, and the tests wait for conditions (`/admin/queue`, `/admin/held`),
never for a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.support.procs import Proc, gateway, running, sim

MODEL = "m"
ADMIN, ALICE, BOB = "sk-admin-reload", "sk-alice-reload", "sk-bob-reload"


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _keys(*names: str) -> str:
    secrets = {"alice": ALICE, "bob": BOB}
    return yaml.safe_dump({"keys": [{"name": n, "sha256": _sha(secrets[n]), "tenant": n,
                                     "max_concurrent": 8} for n in names]})  # fmt: skip


@dataclass
class Stack:
    url: str
    config: Path
    keys: Path
    gw: Proc

    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {ADMIN}"}

    def reload(self) -> httpx.Response:
        return httpx.post(self.url + "/admin/reload", headers=self.admin(), timeout=60)

    def edit(self, **sections: dict[str, Any]) -> None:
        cfg = yaml.safe_load(self.config.read_text())
        for name, values in sections.items():
            cfg.setdefault(name, {}).update(values)
        self.config.write_text(yaml.safe_dump(cfg))

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30)

    def aclient(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                                  timeout=30)  # fmt: skip

    def get(self, path: str) -> Any:
        r = httpx.get(self.url + path, headers=self.admin(), timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def queued(self) -> int:
        return int(sum(self.get("/admin/held")["queued"].values()))

    def inflight(self) -> int:
        return int(sum(self.get("/admin/held")["inflight"].values()))


@contextlib.contextmanager
def _stack(tmp_path: Path, auth: dict[str, Any] | None = None, itl_ms: int = 20) -> Iterator[Stack]:
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, mode="echo", itl_ms=itl_ms)
    keys = tmp_path / "keys.yaml"
    keys.write_text(_keys("alice", "bob"))
    cfg = {
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": w.url, "max_inflight": 1}],
        "routing": {"metrics_interval_s": 3600, "prefix_affinity": False},
        "queue": {"reserved_slots": 0},
        "auth": {
            "enabled": True,
            "admin_key_sha256": _sha(ADMIN),
            "keys_file": str(keys),
            **(auth or {}),
        },
    }
    gw = gateway(cfg, tmp_path)
    with running(w), running(gw, ready_path="/health"):
        stack = Stack(gw.url, next(tmp_path.glob("gpupool-*.yaml")), keys, gw)
        _until(lambda: stack.get("/admin/workers")["data"][0]["state"] == "ready")
        yield stack
        _until(lambda: stack.inflight() == 0 and stack.queued() == 0)
        held = stack.get("/admin/held")
        assert not any(held["slots"].values()) and not any(held["key_slots"].values())


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with _stack(tmp_path) as s:
        yield s


@pytest.fixture(scope="module")
def unchanged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the tests that must leave it as they found it (each checks that it did;
    the stack's end checks that nothing is held)."""
    with _stack(tmp_path_factory.mktemp("unchanged")) as s:
        yield s


def _until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


async def _auntil(condition: Any) -> None:
    deadline = time.monotonic() + 20.0
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _chat(client: openai.OpenAI, text: str = "hi", **kw: Any) -> str:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2, **kw
    )
    return r.choices[0].message.content or ""


def _hold(ms: int) -> dict[str, Any]:
    return {"extra_headers": {"x-sim-hold-ms": str(ms)}}


def test_a_removed_key_gets_401_and_its_queued_request_is_refused(stack: Stack) -> None:
    alice, bob = stack.client(ALICE), stack.client(BOB)
    _chat(alice)  # the key works

    async def scenario() -> tuple[BaseException | str, BaseException | str, dict[str, Any]]:
        a_alice, a_bob = stack.aclient(ALICE), stack.aclient(BOB)
        holder = asyncio.create_task(a_bob.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hold"}], max_tokens=2,
            **_hold(3000)))  # fmt: skip
        await _auntil(lambda: stack.inflight() == 1)
        queued = [{"role": "user", "content": "queued"}]
        waiting = asyncio.create_task(a_alice.chat.completions.create(
            model=MODEL, messages=queued, max_tokens=2))  # fmt: skip
        await _auntil(lambda: stack.queued() == 1)
        stack.keys.write_text(_keys("bob"))
        reply = await asyncio.to_thread(stack.reload)
        assert reply.status_code == 200, reply.text
        results = await asyncio.gather(waiting, holder, return_exceptions=True)
        await a_alice.close()
        await a_bob.close()
        out = [r if isinstance(r, BaseException) else r.choices[0].message.content or ""
               for r in results]  # fmt: skip
        return out[0], out[1], reply.json()

    refused, held, summary = asyncio.run(scenario())
    assert isinstance(refused, openai.AuthenticationError), refused  # 401, not retried
    assert "revoked" in refused.message
    assert isinstance(held, str)  # bob's running request was not touched
    assert summary["keys"] == {"added": [], "removed": ["alice"], "changed": []}
    assert summary["queued_refused"] == 1
    assert summary["settings"] == {"applied": [], "restart_required": []}  # the file's keys
    with pytest.raises(openai.AuthenticationError):
        _chat(alice)  # its next request: 401
    assert _chat(bob)  # the others' keep working

    stack.keys.write_text(_keys("alice", "bob"))  # given back: works again, no restart
    assert stack.reload().json()["keys"]["added"] == ["alice"]
    assert _chat(alice)


def test_a_broken_keys_file_refuses_the_whole_reload_with_its_line(stack: Stack) -> None:
    alice = stack.client(ALICE)
    stack.edit(queue={"max_wait_s": 7})
    good = stack.keys.read_text()
    lines = good.splitlines()
    bad_line = next(i for i, line in enumerate(lines) if "sha256" in line and "bob" not in line)
    lines[bad_line] = lines[bad_line].split(":")[0] + ": not-a-hash"
    stack.keys.write_text("\n".join(lines) + "\n")
    r = stack.reload()
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"{stack.keys}:{bad_line + 1}:" in message and "sha256" in message, message
    assert "nothing changed" in message
    assert _chat(alice)  # old keys still work, and nothing else changed either

    stack.keys.write_text("keys:\n  - {name: x, sha256: [\n")  # not YAML at all
    r = stack.reload()
    assert r.status_code == 400 and f"{stack.keys}:" in r.json()["error"]["message"]

    stack.keys.write_text(good)  # fixed: the same running gateway takes it
    r = stack.reload()
    assert r.status_code == 200, r.text
    assert r.json()["settings"]["applied"] == ["queue.max_wait_s"]
    assert _chat(alice)


def test_an_invalid_config_changes_nothing_and_says_where(stack: Stack) -> None:
    stack.edit(queue={"max_wait_s": -1}, auth={"keys_file": None})
    r = stack.reload()
    assert r.status_code == 400
    line = stack.config.read_text().splitlines().index("  max_wait_s: -1") + 1
    assert f"{stack.config}:{line}: queue.max_wait_s" in r.json()["error"]["message"], r.text
    assert _chat(stack.client(ALICE))  # the keys file was not dropped


def test_the_reply_lists_what_changed_and_what_needs_a_restart(stack: Stack) -> None:
    stack.edit(server={"max_sequences": 2, "port": 1}, queue={"max_queued": 5, "lease_ttl_s": 4},
               routing={"retries": 0})  # fmt: skip
    r = stack.reload()
    assert r.status_code == 200, r.text
    settings = r.json()["settings"]
    assert settings["applied"] == ["server.max_sequences", "queue.max_queued", "routing.retries"]
    assert settings["restart_required"] == ["server.port", "queue.lease_ttl_s"]
    # applied: three embedding inputs are now over the limit of 2 sequences
    with pytest.raises(openai.BadRequestError, match="max_sequences"):
        stack.client(ALICE).embeddings.create(model=MODEL, input=["a", "b", "c"])
    # not applied, so the next reload reports it again until a restart
    again = stack.reload().json()["settings"]
    assert again == {"applied": [], "restart_required": ["server.port", "queue.lease_ttl_s"]}


def test_an_admin_key_change_applies_at_once(stack: Stack) -> None:
    new_admin = "sk-admin-2"
    stack.edit(auth={"admin_key_sha256": _sha(new_admin)})
    assert stack.reload().json()["settings"]["applied"] == ["auth.admin_key_sha256"]
    r = httpx.get(stack.url + "/admin/workers", headers=stack.admin())
    assert r.status_code == 401
    r = httpx.get(stack.url + "/admin/held", headers={"authorization": f"Bearer {new_admin}"})
    assert r.status_code == 200
    # back, for the fixture's own checks
    stack.edit(auth={"admin_key_sha256": _sha(ADMIN)})
    r = httpx.post(stack.url + "/admin/reload", headers={"authorization": f"Bearer {new_admin}"})
    assert r.status_code == 200


@pytest.mark.parametrize("policy", ["finish", "cut"])
def test_a_revoked_keys_running_stream_finishes_or_is_cut(tmp_path: Path, policy: str) -> None:
    with _stack(tmp_path, {"revoked_streams": policy}, itl_ms=100) as stack:
        got: list[str] = []

        async def scenario() -> BaseException | None:
            client = stack.aclient(ALICE)
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "a " * 40}],
                    max_tokens=40, stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        got.append(chunk.choices[0].delta.content)
                    if len(got) == 2:
                        stack.keys.write_text(_keys("bob"))
                        r = await asyncio.to_thread(stack.reload)
                        assert r.status_code == 200
                        held = await asyncio.to_thread(stack.get, "/admin/held")
                        if policy == "finish":  # still shown while it runs
                            assert held["key_slots"].get("alice") == 1, held
            except openai.APIError as e:
                return e
            finally:
                await client.close()
            return None

        error = asyncio.run(scenario())
        if policy == "finish":
            assert error is None and len(got) >= 20, (error, got)
        else:  # ended at its next event after the reload, with the route's error event
            assert isinstance(error, openai.APIError) and "revoked" in str(error), error
            assert len(got) < 20


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-inf", "-1", "1e309", ""])
def test_admin_query_parameters_are_checked_like_a_clients(unchanged: Stack, value: str) -> None:
    stack = unchanged
    r = httpx.post(f"{stack.url}/admin/workers/w/drain?timeout_s={value}", headers=stack.admin())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "timeout_s"
    assert stack.get("/admin/workers/w")["state"] == "ready"  # nothing was drained
    assert stack.inflight() == stack.queued() == 0


def test_admin_routes_refuse_parameters_they_do_not_take(stack: Stack) -> None:
    h = stack.admin()
    for method, path in [("GET", "/admin/workers?x=1"), ("GET", "/admin/workers/w?x=1"),
                         ("POST", "/admin/workers/w/undrain?x=1"), ("GET", "/admin/queue?x=1"),
                         ("GET", "/admin/held?x=1"), ("POST", "/admin/reload?dry_run=1"),
                         ("POST", "/admin/workers/w/drain?timeout=5"),
                         ("POST", "/admin/workers/w/drain?timeout_s=1&timeout_s=2")]:  # fmt: skip
        r = httpx.request(method, stack.url + path, headers=h)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["type"] == "Bad Request"
    r = httpx.post(f"{stack.url}/admin/workers/w/drain?timeout_s=0.5", headers=h)
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    r = httpx.post(f"{stack.url}/admin/workers/w/undrain", headers=h)
    assert r.status_code == 200
    _until(lambda: stack.get("/admin/workers/w")["state"] == "ready")


def test_scores_and_pooling_count_every_sequence(stack: Stack) -> None:
    """5,000 documents are 5,000 sequences against `server.max_sequences` (256), on every
    route that runs one per item; raised by a reload, the same request goes through."""
    h = {"authorization": f"Bearer {ALICE}"}
    docs = [f"document {i}" for i in range(5000)]
    bodies = {
        "/rerank": {"query": "q", "documents": docs},
        "/v1/rerank": {"query": "q", "documents": docs},
        "/v2/rerank": {"query": "q", "documents": docs},
        "/score": {"text_1": "q", "text_2": docs},
        "/v1/score": {"queries": "q", "documents": docs},
        "/v1/embeddings": {"input": docs},
        "/v2/embed": {"texts": docs, "input_type": "search_document"},
        "/classify": {"input": docs},
        "/pooling": {"input": docs},
    }
    for path, body in bodies.items():
        r = httpx.post(stack.url + path, json={"model": MODEL, **body}, headers=h, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert "5000 sequences" in r.json()["error"]["message"], (path, r.text)
    with pytest.raises(openai.BadRequestError, match="max_sequences"):
        stack.client(ALICE).embeddings.create(model=MODEL, input=docs[:257])
    stack.edit(server={"max_sequences": 5000})
    assert stack.reload().json()["settings"]["applied"] == ["server.max_sequences"]
    r = httpx.post(stack.url + "/rerank", json={"model": MODEL, **bodies["/rerank"]}, headers=h,
                   timeout=30)  # fmt: skip
    assert "sequences" not in r.text  # past the gateway (the simulator has no /rerank)


def test_sighup_reloads_as_the_admin_route_does(stack: Stack) -> None:
    alice, bob = stack.client(ALICE), stack.client(BOB)

    def refused(client: openai.OpenAI) -> bool:
        try:
            _chat(client)
        except openai.AuthenticationError:
            return True
        return False

    stack.keys.write_text("keys: [{name: alice, sha256: nope}]\n")  # broken: logged, no change
    stack.gw.kill(signal.SIGHUP)
    _until(lambda: "reload (SIGHUP) refused" in stack.gw.logs())
    assert f"{stack.keys}:1:" in stack.gw.logs()
    assert _chat(alice)
    stack.keys.write_text(_keys("bob"))
    stack.gw.kill(signal.SIGHUP)
    _until(lambda: refused(alice))
    assert _chat(bob)  # the process lives on (a SIGHUP used to end it)
    assert '"removed": ["alice"]' in stack.gw.logs()


def test_the_front_doors_limits_and_headers_change_too(stack: Stack) -> None:
    stack.edit(server={"max_body_bytes": 2000, "expose_worker_header": True})
    applied = stack.reload().json()["settings"]["applied"]
    assert applied == ["server.expose_worker_header", "server.max_body_bytes"]
    alice = stack.client(ALICE)
    with pytest.raises(openai.APIStatusError) as e:
        _chat(alice, "x" * 3000)
    assert e.value.status_code == 413
    r = alice.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.headers["x-gpupool-worker"] == "w"


def test_a_revoked_keys_visibly_queued_stream_ends_with_an_error_event(stack: Stack) -> None:
    """A stream queued with `x-gpupool-queue-events` has its 200 already: refused in-stream."""

    async def scenario() -> bytes:
        bob = stack.aclient(BOB)
        holder = asyncio.create_task(bob.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hold"}], max_tokens=2,
            **_hold(3000)))  # fmt: skip
        await _auntil(lambda: stack.inflight() == 1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "q"}], "stream": True}
        h = {"authorization": f"Bearer {ALICE}", "x-gpupool-queue-events": "true"}
        url = stack.url + "/v1/chat/completions"
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", url, json=body, headers=h) as r,
        ):
            assert r.status_code == 200
            got = b""
            async for chunk in r.aiter_raw():
                got += chunk
                if got == b": queued\n\n":  # in the queue: revoke its key
                    await _auntil(lambda: stack.queued() == 1)
                    stack.keys.write_text(_keys("bob"))
                    assert (await asyncio.to_thread(stack.reload)).status_code == 200
        await holder
        await bob.close()
        return got

    got = asyncio.run(scenario())
    assert b'"code":401' in got and b"revoked" in got and got.endswith(b"data: [DONE]\n\n"), got
