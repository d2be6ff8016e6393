"""A worker that dies mid-answer cuts no stream (issue 36): requests carry on on another worker.

Real `gpupool serve` gateways in front of two simulated workers, once with the memory backend
and once with Redis. The victim's process exits (as ``kill -9`` or a GPU fault) once any of its
streams has sent ``CRASH_AT`` tokens; what the clients read is compared, event by event, with
the same requests answered by a worker left alone: the text whole (nothing repeated or lost at
the cut), one id in every chunk, one role delta, one ``[DONE]``, usage counted once. Afterwards
nothing is held (``assert_nothing_held``), and the metrics, the log and the pool page's recent
events say what moved where.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.ui.pool import first_snapshot
from tests.support.fault_tools import MODEL, async_client, gateway_config, wait_until
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, gateway, redis_server, running, sim
from tests.support.template_tools import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CRASH_AT = 6
MAX_TOKENS = 30
NO_AFFINITY = {"prefix_affinity": False}


def _chat(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"tell me {i}"}],
            "max_tokens": MAX_TOKENS, "stream": True, **extra}  # fmt: skip


def _completion(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"once upon a time {i}", "max_tokens": MAX_TOKENS,
            "stream": True, **extra}  # fmt: skip


USAGE = {"stream_options": {"include_usage": True}}


def _requests() -> list[tuple[str, dict[str, Any]]]:
    reqs: list[tuple[str, dict[str, Any]]] = []
    for i in range(6):
        extra = USAGE if i % 2 else {}
        reqs.append(("/v1/chat/completions", _chat(i, **extra)))
        reqs.append(("/v1/completions", _completion(i, **extra)))
    reqs.append(("/v1/chat/completions", {**_chat(99), "stream": False}))
    reqs.append(("/v1/completions", {**_completion(99), "stream": False}))
    return reqs


class Read:
    """What one client read: its status, the worker header, and the events of a stream."""

    def __init__(self, status: int, worker: str | None, raw: bytes, stream: bool) -> None:
        self.status, self.worker, self.raw, self.stream = status, worker, raw, stream
        self.events = [e for e in raw.split(b"\n\n") if e.strip()] if stream else []

    def objects(self) -> list[dict[str, Any]]:
        return [json.loads(e[6:]) for e in self.events if e.startswith(b"data: {")]

    def text(self) -> str:
        if not self.stream:
            choice = json.loads(self.raw)["choices"][0]
            return str(choice.get("text") or choice.get("message", {}).get("content"))
        out = ""
        for obj in self.objects():
            for c in obj.get("choices", []):
                out += c.get("text") or c.get("delta", {}).get("content") or ""
        return out

    def usage(self) -> dict[str, Any] | None:
        if not self.stream:
            return dict(json.loads(self.raw)["usage"])
        found = [o["usage"] for o in self.objects() if o.get("usage")]
        return found[-1] if found else None


async def _one(c: httpx.AsyncClient, url: str, path: str, payload: dict[str, Any]) -> Read:
    async with c.stream("POST", url + path, json=payload) as r:
        raw = b"".join([chunk async for chunk in r.aiter_raw()])
        return Read(r.status_code, r.headers.get("x-gpupool-worker"), raw, payload["stream"])


async def _all(url: str, reqs: list[tuple[str, dict[str, Any]]]) -> list[Read]:
    async with async_client(len(reqs)) as c:
        return await asyncio.gather(*(_one(c, url, p, b) for p, b in reqs))


def _exited(p: Proc) -> bool:
    return p.proc is not None and p.proc.poll() is not None


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "memory":
        yield None
        return
    redis = redis_server(tmp_path)
    with running(redis):
        yield redis.url


def test_streams_and_whole_answers_continue_when_their_worker_dies(
    tmp_path: Path, backend: str | None
) -> None:
    victim = sim(model=MODEL, tmp=tmp_path, max_num_seqs=16, itl_ms=40, output_tokens=80,
                 crash_after_tokens=CRASH_AT)  # fmt: skip
    other = sim(model=MODEL, tmp=tmp_path, max_num_seqs=16, itl_ms=5, output_tokens=80)
    queue = {"backend": "redis", "redis_url": backend} if backend else None
    # one slot on the other worker: at most one request starts there, so both whole answers
    # cannot, and the moved requests queue for it like any request
    cfg = gateway_config([("victim", victim, 16), ("other", other, 1)], queue=queue,
                         routing=NO_AFFINITY)  # fmt: skip
    gw = gateway(cfg, tmp_path)
    reqs = _requests()
    with running(victim, other), running(gw, ready_path="/ready"):
        reference = asyncio.run(_all(other.url, reqs))  # the same requests, left alone
        reads = asyncio.run(_all(gw.url, reqs))
        wait_until("victim gone", lambda: _exited(victim), 10)
        assert_nothing_held(gw.url)
        moved = metric(gw, "gpupool_migrations_total", cause="worker_died")
        continued = metric(gw, "gpupool_migrations_total", outcome="continued")
        restarted = metric(gw, "gpupool_migrations_total", outcome="restarted")
        log = Path(gw.log_path).read_text()
        page = first_snapshot(gw.url)
    events = [e["message"] for e in page["errors"] if e["source"] == "gpupool.migrate"]
    assert any("worker victim failed mid-answer" in m for m in events), page["errors"][:3]
    assert all(r.status == 200 for r in reads), [
        (r.status, r.raw[:300]) for r in reads if r.status != 200
    ]
    for (path, payload), got, want in zip(reqs, reads, reference, strict=True):
        assert got.text() == want.text(), (path, payload, got.raw[-600:])
        if not payload["stream"]:
            continue
        objects = got.objects()
        assert got.events[-1] == b"data: [DONE]" and got.events.count(b"data: [DONE]") == 1
        assert not any("error" in o for o in objects), got.raw[-300:]
        assert len({o["id"] for o in objects}) == 1, "one id in every chunk"
        assert len({o["created"] for o in objects}) == 1
        roles = [c for o in objects for c in o.get("choices", []) if c.get("delta", {}).get("role")]
        assert len(roles) == (1 if path == "/v1/chat/completions" else 0)
        if payload.get("stream_options"):
            usage, expected = got.usage(), want.usage()
            assert usage is not None and expected is not None
            assert usage["completion_tokens"] == expected["completion_tokens"] == MAX_TOKENS
            assert usage["prompt_tokens"] == expected["prompt_tokens"]
    assert moved >= 1 and continued >= 1 and restarted >= 1, (moved, continued, restarted)
    # the health check may take the dying worker out before its connection closes: either cause
    line = re.search(r"request \S+: worker victim failed mid-answer \((worker_died|worker_out)\); "
                     r"continued after \d+ tokens on worker other", log)  # fmt: skip
    assert line, log[-3000:]
    # the simulator returns token ids as vLLM does: the streams went on from them, not the text
    assert "generated token ids" in log and "returned no token ids" not in log, log[-3000:]


def test_a_request_never_goes_back_to_a_worker_it_left(tmp_path: Path) -> None:
    """Both workers die mid-answer: the stream moves once, then no worker is left that it has
    not tried, and the client gets the stream's error event (no loop, nothing held)."""
    a, b = (
        sim(
            model=MODEL,
            tmp=tmp_path,
            max_num_seqs=4,
            itl_ms=20,
            output_tokens=40,
            crash_after_tokens=3,
        )
        for _ in range(2)
    )
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing=NO_AFFINITY)
    gw = gateway(cfg, tmp_path)
    with running(a, b), running(gw, ready_path="/ready"):
        (read,) = asyncio.run(_all(gw.url, [("/v1/chat/completions", _chat(1))]))
        assert_nothing_held(gw.url)
        continued = metric(gw, "gpupool_migrations_total", outcome="continued")
        failed = metric(gw, "gpupool_migrations_total", outcome="failed")
    assert read.status == 200 and read.events[-1] == b"data: [DONE]"
    assert "error" in read.objects()[-1], read.raw[-300:]
    assert (continued, failed) == (1, 1)


def test_a_stream_its_worker_keeps_silent_moves_at_the_read_deadline(tmp_path: Path) -> None:
    """A worker that stops sending mid-stream (frozen here: SIGSTOP) is left at
    ``upstream_read_timeout_s``: the stream goes on on the other worker, the bound is counted
    against the silent one and logged, and it has the undisturbed text."""
    slow = sim(model=MODEL, tmp=tmp_path, max_num_seqs=4, itl_ms=50, output_tokens=80)
    other = sim(model=MODEL, tmp=tmp_path, max_num_seqs=4, itl_ms=5, output_tokens=80)
    cfg = gateway_config([("slow", slow, 1), ("other", other, 1)], routing=NO_AFFINITY,
                         server={"upstream_read_timeout_s": 1.0})  # fmt: skip
    gw = gateway(cfg, tmp_path)
    reqs = [("/v1/chat/completions", _chat(i)) for i in range(2)]
    with running(slow, other), running(gw, ready_path="/ready"):
        reference = asyncio.run(_all(other.url, reqs))

        async def scenario() -> list[Read]:
            async with async_client(2) as c:
                tasks = [asyncio.create_task(_one(c, gw.url, p, b)) for p, b in reqs]
                await asyncio.to_thread(wait_until, "slow streaming", lambda: _running(slow), 15)
                await asyncio.sleep(0.2)  # a few of its tokens went out
                slow.kill(signal.SIGSTOP)  # frozen mid-stream
                return list(await asyncio.gather(*tasks))

        try:
            reads = asyncio.run(scenario())
        finally:
            slow.kill(signal.SIGCONT)
        assert_nothing_held(gw.url)
        moved = metric(gw, "gpupool_migrations_total", cause="timeout", outcome="continued")
        log = Path(gw.log_path).read_text()
    assert [r.text() for r in reads] == [r.text() for r in reference]
    assert all(not any("error" in o for o in r.objects()) for r in reads)
    assert moved == 1
    assert "worker slow crossed upstream_read_timeout_s" in log
    assert re.search(r"worker slow failed mid-answer \(timeout\); continued after \d+ tokens "
                     r"on worker other", log)  # fmt: skip


def _running(p: Proc) -> int:
    return int(httpx.get(p.url + "/sim/stats", timeout=5).json()["running"])


def test_a_url_workers_drain_moves_what_outlives_its_deadline(tmp_path: Path) -> None:
    """``drain?timeout_s=`` on a ``url:`` worker: its streams still running at the deadline go
    on on the other worker (cause ``drain``) instead of running on after it stopped."""
    a = sim(model=MODEL, tmp=tmp_path, max_num_seqs=4, itl_ms=60, output_tokens=80)
    b = sim(model=MODEL, tmp=tmp_path, max_num_seqs=4, itl_ms=5, output_tokens=80)
    cfg = gateway_config([("a", a, 2), ("b", b, 2)], routing=NO_AFFINITY)
    gw = gateway(cfg, tmp_path)
    reqs = [("/v1/completions", _completion(i, **USAGE)) for i in range(4)]
    with running(a, b), running(gw, ready_path="/ready"):
        reference = asyncio.run(_all(b.url, reqs))

        async def scenario() -> list[Read]:
            async with async_client(4) as c:
                tasks = [asyncio.create_task(_one(c, gw.url, p, body)) for p, body in reqs]
                await asyncio.to_thread(wait_until, "a streaming", lambda: _running(a) == 2, 15)
                r = await c.post(gw.url + "/admin/workers/a/drain?timeout_s=0.3")
                assert r.status_code == 200 and r.json()["state"] == "stopped", r.text
                return list(await asyncio.gather(*tasks))

        reads = asyncio.run(scenario())
        assert_nothing_held(gw.url)
        moved = metric(gw, "gpupool_migrations_total", cause="drain", outcome="continued")
    assert [r.text() for r in reads] == [r.text() for r in reference]
    assert [r.usage() for r in reads] == [r.usage() for r in reference]
    assert moved == 2


def test_a_used_up_migration_that_a_retry_saves_is_not_counted_failed(tmp_path: Path) -> None:
    """``routing.migrations: 1``: a whole answer's worker is killed before it answered (it
    moves once), then the next one is too. Its migrations are used up, but the dispatcher's
    retry (a worker that died before the first byte, ``routing.retries``) takes it to a third
    worker: the client gets its answer, and no migration is counted ``failed``."""
    a, b = (sim(model=MODEL, tmp=tmp_path, max_num_seqs=2, itl_ms=50, output_tokens=80)
            for _ in range(2))  # fmt: skip
    c = sim(model=MODEL, tmp=tmp_path, max_num_seqs=2, itl_ms=1, output_tokens=80)
    # a, b, c in that order on equal load (a rank's last key is the name); health checks too
    # slow to take a dead worker out before the gateway reads its closed connection
    routing = {**NO_AFFINITY, "migrations": 1, "health_interval_s": 5.0}
    cfg = gateway_config([("a", a, 2), ("b", b, 2), ("c", c, 2)], routing=routing)
    gw = gateway(cfg, tmp_path)
    req = ("/v1/completions", {**_completion(7), "stream": False})
    with running(a, b, c), running(gw, ready_path="/ready"):
        (reference,) = asyncio.run(_all(c.url, [req]))

        async def scenario() -> Read:
            async with async_client(1) as client:
                task = asyncio.create_task(_one(client, gw.url, *req))
                for victim in (a, b):
                    busy = functools.partial(_running, victim)
                    await asyncio.to_thread(wait_until, "answering", busy, 15)
                    victim.kill()
                return await task

        read = asyncio.run(scenario())
        assert_nothing_held(gw.url)
        restarted = metric(gw, "gpupool_migrations_total", outcome="restarted")
        failed = metric(gw, "gpupool_migrations_total", outcome="failed")
    assert read.status == 200, read.raw[:300]
    assert read.worker == "c"
    assert read.text() == reference.text()
    assert (restarted, failed) == (1, 0)
