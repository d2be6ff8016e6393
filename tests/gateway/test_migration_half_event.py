"""A stream whose worker died halfway through an event continues without that half event."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from gpupool.gateway.pipeline.kinds import Shape
from gpupool.gateway.pipeline.relay import Relay
from gpupool.gateway.transform.continuation import Resume
from gpupool.gateway.upstream.common import UpstreamFailure


class _Resp:
    def __init__(self, chunks: list[bytes], fail: bool) -> None:
        self.chunks, self.fail = chunks, fail

    async def iter_raw(self) -> Any:
        for c in self.chunks:
            yield c
        if self.fail:
            raise UpstreamFailure("worker died", sent=True)


def test_half_event_of_dead_worker_never_reaches_client() -> None:
    first = _Resp(
        [b'data: {"id":"a","choices":[{"index":0,"text":"Hi"}]}\n\n', b'data: {"id":"a","choi'],
        fail=True,
    )
    second = _Resp(
        [b'data: {"id":"b","choices":[{"index":0,"text":" there"}]}\n\n', b"data: [DONE]\n\n"],
        fail=False,
    )
    plan = SimpleNamespace(kind=SimpleNamespace(usage_option=True, shape=Shape.none), token_ids=0)
    ex = SimpleNamespace(resp=first, plan=plan)
    relay = Relay.__new__(Relay)
    relay.migrator = SimpleNamespace(limit=1)  # type: ignore[assignment]
    relay.max_event_bytes = 1 << 20

    async def cont(ex: Any, e: Any, progress: Any) -> Resume:
        ex.resp = second
        return Resume(progress)

    relay._continue = cont  # type: ignore[method-assign]

    async def read() -> bytes:
        return b"".join([c async for c in relay._raw(ex)])  # type: ignore[arg-type]

    out = asyncio.run(read())
    assert out.endswith(b"data: [DONE]\n\n"), out
    assert b"choi" not in out.split(b'" there"')[1]
