"""Precise routing never fails a request and never queues without bound: a prompt its tokenizer
cannot take, or a burst past ``max_pending`` prompts on the threads, routes approximately."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

from gpupool.gateway.kvroute.predict import KvRouting
from gpupool.gateway.routing.policy import RouteRequest
from gpupool.workers.kvevents import hashing
from gpupool.workers.kvevents.pool import KvPool
from gpupool.workers.kvevents.render import PromptRenderer
from gpupool.workers.registry import Worker

BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}


class _Renderer:
    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail, self.gate, self.inside = fail, threading.Event(), threading.Semaphore(0)

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if self.fail is not None:
            raise self.fail
        self.inside.release()
        self.gate.wait(10)
        return list(range(40))


class _NoIndex:
    def index(self, name: str) -> None:
        return None


class _Routing(KvRouting):
    """Every worker known exactly; the renderer is the test's."""

    def __init__(self, renderer: _Renderer, max_pending: int = 64) -> None:
        # every prompt to the threads, which the test's renderer holds (none is short)
        super().__init__(cast(KvPool, _NoIndex()), {}, max_pending=max_pending, inline_chars=-1)
        self.renderer = renderer

    def _check(self, w: Worker) -> tuple[str, hashing.HashSpec | None]:
        return "", hashing.HashSpec(16, "sha256", hashing.DEFAULT_SEED)

    async def _renderer(self, model: str) -> PromptRenderer | str:
        return cast(PromptRenderer, self.renderer)


def _route() -> RouteRequest:
    return RouteRequest("m", 40, True)


WORKER = cast(Worker, type("W", (), {"name": "w1", "model": "m", "cache_info": None})())


def test_a_tokenizer_failure_routes_approximately() -> None:
    kv = _Routing(_Renderer(RecursionError("template recursion")))
    try:
        out = asyncio.run(kv.predict(_route(), "/v1/chat/completions", BODY, None, [WORKER]))
    finally:
        kv.close()
    assert out.kv is None
    assert kv.routed == {("m", "approximate: tokenizing failed"): 1}
    assert kv._pending == 0


def test_past_max_pending_a_request_does_not_queue_for_the_threads() -> None:
    renderer = _Renderer()
    kv = _Routing(renderer, max_pending=2)

    async def burst() -> list[RouteRequest]:
        held = [
            asyncio.ensure_future(
                kv.predict(_route(), "/v1/chat/completions", BODY, None, [WORKER])
            )
            for _ in range(2)
        ]
        for _ in held:  # both on the threads, held there
            assert await asyncio.to_thread(renderer.inside.acquire, True, 10)
        third = await kv.predict(_route(), "/v1/chat/completions", BODY, None, [WORKER])
        renderer.gate.set()
        return [third, *await asyncio.gather(*held)]

    try:
        third, *_ = asyncio.run(burst())
    finally:
        kv.close()
    assert third.kv is None
    assert kv.routed[("m", "approximate: tokenizer busy")] == 1
    assert kv._pending == 0


class _Where:
    """A renderer that notes the thread each prompt was tokenized on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return list(range(40))


def test_a_short_prompt_is_tokenized_on_the_loop_a_long_one_on_the_threads() -> None:
    renderer = _Where()
    kv = _Routing(cast(_Renderer, renderer))
    kv.inline_chars = 100
    long = {"messages": [{"role": "system", "content": "x" * 101}, BODY["messages"][0]]}
    many = {"messages": BODY["messages"] * 9}  # short text, but more messages than inline

    async def three() -> list[RouteRequest]:
        return [
            await kv.predict(_route(), "/v1/chat/completions", b, None, [WORKER])
            for b in (BODY, long, many)
        ]

    try:
        outs = asyncio.run(three())
    finally:
        kv.close()
    assert all(o.kv is not None and o.kv.tokens == 40 for o in outs)
    main = threading.main_thread().name
    assert renderer.threads[0] == main
    assert all(t.startswith("gpupool-kv") for t in renderer.threads[1:])
    assert kv.routed == {("m", "precise"): 3}
