"""Long prompts prefilled one at a time per worker (``pipeline/prefill.py``), in-process.

The worker is ``FakePath`` (``test_pipeline.py``): a stream's first chunk comes only when the
test lets it, as vLLM's first event comes after the prefill. Every test ends with nothing held:
no slot, no key slot, no queue entry, no gate turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from gpupool.gateway.pipeline.prefill import PrefillGate
from tests.gateway.test_pipeline import (
    CHUNKS,
    FakePath,
    FakeResponse,
    Handler,
    Rig,
    _finish,
    _handle,
    rig,
)

LONG = " ".join(["word"] * 200)  # far more than the gate's 50 tokens at any bytes per token


class HeldStream(FakeResponse):
    """A stream whose chunks wait for ``first`` (the prefill) to be set."""

    def __init__(self, first: asyncio.Event) -> None:
        super().__init__(chunks=CHUNKS, content_type="text/event-stream")
        self.first = first

    async def iter_raw(self) -> AsyncIterator[bytes]:
        await self.first.wait()
        for c in self.chunks:
            yield c


class Worker:
    """Each call gets its own prefill event, in call order."""

    def __init__(self) -> None:
        self.prefills: list[asyncio.Event] = []

    def __call__(self, url: str, body: bytes) -> FakeResponse:
        if b'"stream":true' not in body:
            return FakeResponse()
        ev = asyncio.Event()
        self.prefills.append(ev)
        return HeldStream(ev)


def gated_rig(handler: Handler | None = None, max_wait_s: float = 5.0) -> Rig:
    """Four slots on one worker, a gate at 50 tokens."""
    r = rig(FakePath(handler or Worker()), capacity=4)
    r.pipeline.dispatcher.gate = PrefillGate(50, max_wait_s)
    return r


def body(prompt: str, stream: bool = True) -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream})


async def until(cond: object) -> None:
    for _ in range(400):  # 2 s
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def read(reply_task: asyncio.Future[object]) -> bytes:
    return await _finish(await reply_task)  # type: ignore[arg-type]


async def one_prefilling() -> tuple[Worker, Rig, asyncio.Future[object]]:
    """A gated rig whose worker is prefilling one long stream (its reply still to come)."""
    w = Worker()
    r = gated_rig(w)
    first: asyncio.Future[object] = asyncio.ensure_future(_handle(r, body(LONG)))
    await until(lambda: len(w.prefills) == 1)
    return w, r, first


async def nothing_held(r: Rig) -> None:
    assert await r.held() == 0
    assert r.pipeline.dispatcher.gate.held() == 0


async def test_a_long_stream_waits_for_the_long_prefill_before_it() -> None:
    w, r, first = await one_prefilling()
    second = asyncio.ensure_future(_handle(r, body(LONG + " more")))
    await asyncio.sleep(0.05)
    assert len(r.path.calls) == 1  # holding its slot, not sent
    one = asyncio.ensure_future(read(first))
    w.prefills[0].set()  # the first one's first event
    await until(lambda: len(w.prefills) == 2)
    w.prefills[1].set()
    assert (await one).endswith(b"data: [DONE]\n\n")
    assert (await read(second)).endswith(b"data: [DONE]\n\n")
    await nothing_held(r)


async def test_a_short_prompt_does_not_wait() -> None:
    w, r, first = await one_prefilling()
    short = asyncio.ensure_future(_handle(r, body("hi")))
    await until(lambda: len(w.prefills) == 2)  # sent while the long one prefills
    for ev in w.prefills:
        ev.set()
    await read(first)
    await read(short)
    await nothing_held(r)


async def test_a_whole_body_request_does_not_wait() -> None:
    """Its first token is invisible to the gateway (the body comes at the end): it neither
    waits nor holds the worker for the whole answer."""
    w, r, first = await one_prefilling()
    await _finish(await _handle(r, body(LONG, stream=False)))
    w.prefills[0].set()
    await read(first)
    await nothing_held(r)


async def test_cancelled_while_waiting_at_the_gate_holds_nothing() -> None:
    w, r, first = await one_prefilling()
    second = asyncio.ensure_future(_handle(r, body(LONG)))
    await asyncio.sleep(0.05)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert len(r.path.calls) == 1
    w.prefills[0].set()
    await read(first)
    await nothing_held(r)


async def test_a_client_gone_before_the_first_event_lets_the_next_one_in() -> None:
    w = Worker()
    r = gated_rig(w)
    first = await _handle(r, body(LONG))
    second = asyncio.ensure_future(_handle(r, body(LONG)))
    await asyncio.sleep(0.05)
    assert len(r.path.calls) == 1
    await _finish(first, read=False)  # the client reset before any byte was written
    await until(lambda: len(w.prefills) == 2)
    w.prefills[1].set()
    await read(second)
    await nothing_held(r)


async def test_an_error_answer_ends_the_turn_at_once() -> None:
    calls: list[int] = []
    gate = asyncio.Event()

    async def answer(url: str, b: bytes) -> FakeResponse:
        calls.append(1)
        if len(calls) == 1:
            return FakeResponse(status=400, body=b'{"error":{"message":"bad"}}')
        await gate.wait()
        return FakeResponse(chunks=CHUNKS, content_type="text/event-stream")

    r = gated_rig(answer)
    bad = await _handle(r, body(LONG))
    assert bad.status == 400
    second = asyncio.ensure_future(_handle(r, body(LONG)))
    await until(lambda: len(calls) == 2)  # not held back by the 400, still unclosed
    await _finish(bad)
    gate.set()
    await read(second)
    await nothing_held(r)


async def test_a_stuck_prefill_holds_the_next_one_back_at_most_max_wait() -> None:
    w = Worker()
    r = gated_rig(w, max_wait_s=0.1)
    first = await _handle(r, body(LONG))
    second = asyncio.ensure_future(_handle(r, body(LONG)))
    await until(lambda: len(w.prefills) == 2)  # went beside the stuck one after 0.1 s
    w.prefills[1].set()
    await read(second)
    w.prefills[0].set()
    await _finish(first)
    await nothing_held(r)
