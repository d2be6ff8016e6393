"""The request pipeline in-process, with a fake data path: every exit releases everything.

A fake worker pool is one class (``FakePath``, the ``DataPath`` seam). Each test drives
``Pipeline.handle`` as the front door does (``reply.after()`` once the reply is written or
abandoned) and then checks that in-flight counts, admission slots, the queue and key slots are
all back to zero, including when the task is cancelled at each await.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.admission.memory import MemoryAdmission
from gpupool.gateway.api.app import create_app
from gpupool.gateway.catalog import Catalog
from gpupool.gateway.errors import InvalidBody, QueueTimeout, UpstreamUnavailable
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.kinds import KINDS
from gpupool.gateway.pipeline.pipeline import Pipeline
from gpupool.gateway.reply import Reply
from gpupool.gateway.routing.policy import Router
from gpupool.gateway.security.keys import KeyStore
from gpupool.gateway.security.limits import KeyLimits
from gpupool.gateway.services import RegistryView, build_services
from gpupool.gateway.upstream.client import Response, UpstreamFailure
from gpupool.workers.registry import Registry, Worker, WorkerState

MODEL = "m"
KEY = "sk-pair"
COMPLETION = orjson.dumps({"id": "c", "object": "text_completion", "model": MODEL,
                           "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 2, "completion_tokens": 3,
                                     "total_tokens": 5}})  # fmt: skip
CHUNKS = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n',
          b'data: {"choices":[{"index":0,"text":"b"}]}\n\n', b"data: [DONE]\n\n"]  # fmt: skip


@dataclass
class FakeResponse:
    status: int = 200
    body: bytes = COMPLETION
    chunks: list[bytes] = field(default_factory=list)
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    closed: bool = False

    async def read(self) -> bytes:
        return self.body

    def read_now(self) -> bytes | None:
        return None  # as a body still arriving: the pipeline awaits ``read``

    async def iter_raw(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            await asyncio.sleep(0)
            yield c

    def close(self) -> None:
        self.closed = True


Handler = Callable[[str, bytes], Any]


class FakePath:
    """Workers as a function of (url, body): a response, or an awaitable of one."""

    def __init__(self, handler: Handler | None = None) -> None:
        self.handler = handler or (lambda url, body: FakeResponse())
        self.calls: list[tuple[str, bytes]] = []
        self.heads: list[Mapping[str, str] | bytes] = []  # the headers of each call
        self.responses: list[FakeResponse] = []

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | bytes,
        stream: bool = False,
    ) -> Response:
        self.calls.append((url, body or b""))
        self.heads.append(headers)
        out = self.handler(url, body or b"")
        if asyncio.iscoroutine(out):
            out = await out
        if isinstance(out, Exception):
            raise out
        self.responses.append(out)
        return out  # type: ignore[no-any-return]


def _cfg(capacity: int = 1, workers: int = 1) -> GpupoolConfig:
    return GpupoolConfig.model_validate({
        "models": [{"name": MODEL}],
        "workers": [{"name": f"w{i}", "model": MODEL, "url": f"http://w{i}",
                     "max_inflight": capacity} for i in range(workers)],
        "auth": {"enabled": True, "keys": [
            {"name": "pair", "sha256": hashlib.sha256(KEY.encode()).hexdigest(),
             "max_concurrent": 2}]},
        "queue": {"max_wait_s": 5},
    })  # fmt: skip


@dataclass
class Rig:
    pipeline: Pipeline
    registry: Registry
    admission: MemoryAdmission
    limits: KeyLimits
    path: FakePath
    keys: KeyStore

    def incoming(self, headers: list[tuple[bytes, bytes]] | None = None) -> Incoming:
        principal = self.keys.identify(KEY)
        return Incoming("rid", [(b"authorization", f"Bearer {KEY}".encode()), *(headers or [])],
                        principal)  # fmt: skip

    async def held(self) -> int:
        snap = await self.admission.snapshot()
        return (sum(w.inflight for w in self.registry)
                + sum(v["held"] for v in snap["workers"].values())
                + sum(v["depth"] for v in snap["models"].values())
                + await self.limits.in_use("pair"))  # fmt: skip


def rig(path: FakePath, capacity: int = 1, workers: int = 1, router: Router | None = None) -> Rig:
    cfg = _cfg(capacity, workers)
    registry = Registry()
    for wc in cfg.workers:
        w = Worker(name=wc.name, model=MODEL, url=wc.url, capacity=capacity, max_model_len=4096)
        w.set_state(WorkerState.ready)
        registry.add(w)
    admission = MemoryAdmission.from_config(cfg.queue, RegistryView(registry), "r1")
    limits = KeyLimits()
    pipeline = Pipeline(cfg, registry, Catalog(cfg.models), router or Router(), admission, path,
                        Metrics(), limits)  # fmt: skip
    return Rig(pipeline, registry, admission, limits, path, KeyStore(cfg.auth))


def _completion(stream: bool = False) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream})


async def _handle(r: Rig, raw: bytes, path: str = "/v1/completions", **kw: Any) -> Reply:
    return await r.pipeline.handle(KINDS[path], r.incoming(**kw), raw)


async def _finish(reply: Reply, read: bool = True) -> bytes:
    """What the front door does: write the reply (or not), then always run ``after``."""
    out = reply.body
    try:
        if read and reply.stream is not None:
            out = b"".join([c async for c in reply.stream])
    finally:
        if reply.after is not None:
            await reply.after()
    return out


async def test_whole_reply_holds_its_slot_until_written() -> None:
    r = rig(FakePath())
    reply = await _handle(r, _completion())
    assert reply.status == 200 and await r.held() == 3  # in flight, its lease, the key slot
    await _finish(reply)
    assert await r.held() == 0
    assert r.path.responses[0].closed


async def test_stream_that_never_starts_is_released() -> None:
    """The leak of issue 11: a client resets before the stream's first chunk is written."""
    r = rig(FakePath(lambda u, b: FakeResponse(chunks=CHUNKS, content_type="text/event-stream")))
    reply = await _handle(r, _completion(stream=True))
    assert reply.stream is not None
    await _finish(reply, read=False)
    assert await r.held() == 0
    assert r.path.responses[0].closed  # the worker connection dropped: vLLM aborts


async def test_stream_read_to_the_end_is_released() -> None:
    r = rig(FakePath(lambda u, b: FakeResponse(chunks=CHUNKS, content_type="text/event-stream")))
    out = await _finish(await _handle(r, _completion(stream=True)))
    assert out.endswith(b"data: [DONE]\n\n")
    assert await r.held() == 0


def _answer_after(gate: asyncio.Event) -> Handler:
    """A worker that answers once ``gate`` is set."""

    async def slow(url: str, body: bytes) -> FakeResponse:
        await gate.wait()
        return FakeResponse()

    return slow


async def test_cancelled_while_queued_leaves_the_queue() -> None:
    gate = asyncio.Event()
    r = rig(FakePath(_answer_after(gate)))
    first = asyncio.ensure_future(_handle(r, _completion()))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(_handle(r, _completion()))
    await asyncio.sleep(0.01)
    assert (await r.admission.snapshot())["models"][MODEL]["depth"] == 1
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    first.cancel()  # and the first is cancelled while its worker has not answered
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await r.held() == 0
    assert len(r.path.calls) == 1  # the queued one was never sent


async def test_queue_timeout_is_a_429_and_releases_the_key() -> None:
    gate = asyncio.Event()
    r = rig(FakePath(_answer_after(gate)))
    first = asyncio.ensure_future(_handle(r, _completion()))
    await asyncio.sleep(0.01)
    with pytest.raises(QueueTimeout):
        await _handle(r, _completion(stream=True), headers=[(b"x-gpupool-max-wait", b"0.05")])
    gate.set()
    await _finish(await first)
    assert await r.held() == 0


async def test_retry_before_the_first_byte_moves_the_slot() -> None:
    def answer(url: str, body: bytes) -> FakeResponse | Exception:
        if url.startswith("http://w0"):
            return UpstreamFailure("refused", sent=False)
        return FakeResponse()

    r = rig(FakePath(answer), workers=2)
    reply = await _handle(r, _completion())
    assert reply.status == 200
    assert [u.split("/")[2] for u, _ in r.path.calls] in (["w0", "w1"], ["w1"])
    await _finish(reply)
    assert await r.held() == 0


async def test_worker_error_after_sending_is_502_and_releases() -> None:
    r = rig(FakePath(lambda u, b: UpstreamFailure("reset", sent=True)))
    with pytest.raises(Exception) as e:
        await _handle(r, _completion())
    assert getattr(e.value, "status", None) == 502
    assert await r.held() == 0


async def test_no_worker_left_is_503_and_releases_the_key() -> None:
    r = rig(FakePath(lambda u, b: UpstreamFailure("refused", sent=False)))
    with pytest.raises(UpstreamUnavailable):
        await _handle(r, _completion())
    assert await r.held() == 0


async def test_opt_in_queued_stream_abandoned_before_it_starts_is_released() -> None:
    r = rig(FakePath(lambda u, b: FakeResponse(chunks=CHUNKS, content_type="text/event-stream")))
    reply = await _handle(r, _completion(stream=True),
                          headers=[(b"x-gpupool-queue-events", b"true")])  # fmt: skip
    assert reply.status == 200 and reply.stream is not None
    await _finish(reply, read=False)
    assert await r.held() == 0
    out = await _finish(await _handle(r, _completion(stream=True),
                                      headers=[(b"x-gpupool-queue-events", b"1")]))  # fmt: skip
    assert out.startswith(b": queued\n\n") and out.endswith(b"data: [DONE]\n\n")
    assert await r.held() == 0


@pytest.mark.parametrize("path", sorted(KINDS))
async def test_every_route_takes_and_returns_a_slot(path: str) -> None:
    r = rig(FakePath())
    body = {"model": MODEL, "prompt": "hi", "input": "hi", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    reply = await _handle(r, orjson.dumps(body), path)
    assert await r.held() == 3
    assert r.path.calls[0][0] == "http://w0" + path
    await _finish(reply)
    assert await r.held() == 0


async def test_the_worker_sees_the_clients_headers_but_hop_by_hop_and_ours() -> None:
    r = rig(FakePath())
    sent = [(b"x-trace", b"abc"), (b"connection", b"keep-alive"), (b"x-gpupool-priority", b"1"),
            (b"content-type", b"text/plain"), (b"x-request-id", b"theirs")]  # fmt: skip
    await _finish(await _handle(r, _completion(), headers=sent))
    assert r.path.heads == [
        b"x-trace: abc\r\ncontent-type: application/json\r\nx-request-id: rid\r\n"
    ]
    assert await r.held() == 0


async def test_a_header_with_a_line_break_is_a_400_and_takes_nothing() -> None:
    r = rig(FakePath())
    with pytest.raises(InvalidBody, match="line break"):
        await _handle(r, _completion(), headers=[(b"x-trace", b"a\r\nx-evil: 1")])
    assert r.path.calls == [] and await r.held() == 0


async def test_front_door_in_process_through_create_app() -> None:
    """The same pipeline behind the real ASGI front door (no sockets)."""
    cfg = _cfg()
    svc = build_services(cfg)
    path = FakePath()
    r = rig(path)
    svc.pipeline = r.pipeline
    app = create_app(cfg, svc=svc)
    app.app.state.services = svc  # what the lifespan does
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        ok = await client.post("/v1/completions", content=_completion(),
                               headers={"authorization": f"Bearer {KEY}"})  # fmt: skip
        bad = await client.post("/v1/completions", content=_completion(),
                                headers={"authorization": f"Bearer {KEY}",
                                         "x-gpupool-priority": "nan"})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 5
    assert bad.status_code == 400
    assert await r.held() == 0
    await svc.client.close()


def _windows_rig(path: FakePath, windows: tuple[int, ...]) -> Rig:
    r = rig(path, capacity=4, workers=len(windows))
    for w, window in zip(r.registry, windows, strict=True):
        w.max_model_len = window
    return r


def _chat_of(chars: int) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "x" * chars}]})  # fmt: skip


async def test_a_prompt_clear_of_its_window_is_routed_without_a_count() -> None:
    """About 3,000 tokens by its bytes: only the 8K window can hold it, far from its edge, so
    no `/tokenize` round trip before sending."""
    r = _windows_rig(FakePath(), (2048, 8192))
    await _finish(await _handle(r, _chat_of(9000), "/v1/chat/completions"))
    assert [u for u, _ in r.path.calls] == ["http://w1/v1/chat/completions"]


async def test_a_prompt_near_a_window_edge_is_counted_exactly() -> None:
    counted = orjson.dumps({"count": 1500, "max_model_len": 8192})

    def answer(url: str, body: bytes) -> FakeResponse:
        return FakeResponse(body=counted) if url.endswith("/tokenize") else FakeResponse()

    r = _windows_rig(FakePath(answer), (2048, 8192))
    await _finish(await _handle(r, _chat_of(5800), "/v1/chat/completions"))
    urls = [u for u, _ in r.path.calls]
    assert urls[0].endswith("/tokenize")  # ~1,930 by its bytes: too near 2,048 to guess
    assert urls[1] == "http://w0/v1/chat/completions"  # counted 1,500: the small window
    assert await r.held() == 0


async def test_a_prompt_denser_than_the_estimate_is_moved_once_then_placed_right() -> None:
    """4,500 bytes of a text at 1.7 bytes a token (2,650 tokens): bytes / 3 says it fits the
    2K window. The first goes there and is moved on its context-length 400; the second, by what
    that 400 proved, is too near the 2K edge to guess and is counted; the third is placed on the
    8K window at once."""
    too_long = b'{"error":{"message":"This model\'s maximum context length is 2048 tokens."}}'
    counted = orjson.dumps({"count": 2650, "max_model_len": 8192})

    def answer(url: str, body: bytes) -> FakeResponse:
        if url.endswith("/tokenize"):
            return FakeResponse(body=counted)
        return FakeResponse(400, too_long) if url.startswith("http://w0") else FakeResponse()

    r = _windows_rig(FakePath(answer), (2048, 8192))
    sent = []
    for _ in range(3):
        r.path.calls.clear()
        reply = await _handle(r, _chat_of(4500), "/v1/chat/completions")
        assert reply.status == 200
        await _finish(reply)
        sent.append([u.removeprefix("http://") for u, _ in r.path.calls])
    chat = "/v1/chat/completions"
    assert sent == [["w0" + chat, "w1" + chat], ["w1/tokenize", "w1" + chat], ["w1" + chat]]
    assert await r.held() == 0


def test_every_turn_of_a_conversation_has_the_same_key() -> None:
    from gpupool.gateway.parse import parse_generate

    def key(messages: list[dict[str, str]]) -> int | None:
        raw = orjson.dumps({"model": MODEL, "messages": messages})
        return parse_generate(raw, chat=True, max_depth=64).prefix_key

    first = [{"role": "user", "content": "plan a trip"}]
    second = [*first, {"role": "assistant", "content": "where?"},
              {"role": "user", "content": "Lisbon"}]  # fmt: skip
    other = [{"role": "user", "content": "write a poem"}]
    system = [{"role": "system", "content": "be brief"}]
    assert key(first) == key(second) != key(other)
    assert key(system + first) == key(system + second) != key(system + other)


class _Timed(Router):
    """A router that keeps the times it was told (``served``): the pace samples."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def served(self, req: Any, worker: str, seconds: float = 0.0, output_tokens: int = 0) -> None:
        self.times.append(seconds)
        super().served(req, worker, seconds, output_tokens)


async def test_only_requests_that_generate_now_are_pace_samples() -> None:
    """A background create is answered at once and generates later; a stored response's GET
    is answered with the stored one's usage: neither times the worker's generation, so
    neither teaches the router how fast it is (``routing/pace.py``). A completion does. (A
    stored response's plans, ``stored.py``, are never paced: ``Plan.paced`` defaults to no.)"""
    queued = orjson.dumps({"id": "resp_1", "object": "response", "status": "queued",
                           "model": MODEL, "output": [], "usage": None})  # fmt: skip
    timed = _Timed()
    r = rig(FakePath(lambda url, body: FakeResponse(body=queued) if "responses" in url
                     else FakeResponse()), router=timed)  # fmt: skip
    background = orjson.dumps({"model": MODEL, "input": "hi", "max_output_tokens": 64,
                               "background": True})  # fmt: skip
    await _finish(await _handle(r, background, "/v1/responses"))
    await _finish(await _handle(r, _completion()))
    assert len(timed.times) == 2 and timed.times[0] == 0.0 and timed.times[1] > 0
    assert await r.held() == 0
