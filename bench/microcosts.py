"""What single steps of the hot path cost, alone, in microseconds (for docs/performance.md).

    .venv/bin/python bench/microcosts.py

Each line times one step that a request takes today against a leaner way of doing the same, on
this interpreter under uvloop, pinned to one core. Steps are timed in loops of many thousand, so
the figures are per call with warm caches: a floor for what the same step costs inside a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvloop
from prometheus_client import CollectorRegistry, Counter, Histogram

from gpupool.gateway.metrics import HotCounter, HotHistogram

BODY = b'{"model":"fast","messages":[{"role":"user","content":"Say something."}],"max_tokens":64}'
MARKERS = (b"image", b"video", b"audio", b"\\u")
MARKER_RE = re.compile(rb"image|video|audio|\\u")
HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"),
    (b"accept", b"application/json"),
    (b"content-type", b"application/json"),
    (b"user-agent", b"OpenAI/Python 1.99.0"),
    (b"x-stainless-lang", b"python"),
    (b"x-stainless-package-version", b"1.99.0"),
    (b"x-stainless-os", b"Linux"),
    (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"CPython"),
    (b"authorization", b"Bearer sk-not-a-real-key-0123456789"),
    (b"content-length", b"96"),
]
DROP = frozenset({b"host", b"connection", b"content-length", b"accept-encoding"})


@dataclass(slots=True)
class _Attempt:  # the shape of proxy.Attempt: five fields and a default factory
    path: str
    body: bytes
    stream: bool
    model: str
    route: object
    tried: set[str] = field(default_factory=set)


def per_call_us(fn: Callable[[], object], n: int = 200_000) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / n


async def in_loop_us(fn: Callable[[], object], n: int = 100_000) -> float:
    """Per call, with the loop turning every 50 calls (timers are closed on the loop's turn,
    so a tight loop that never yields would measure a pile-up, not a request)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n // 50):
            for _ in range(50):
                fn()
            await asyncio.sleep(0)
        spent = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n // 50):
            await asyncio.sleep(0)
        best = min(best, spent - (time.perf_counter() - t0))
    return 1e6 * best / n


async def rows() -> list[tuple[str, float, str, float]]:
    loop = asyncio.get_running_loop()
    reg = CollectorRegistry()
    counter = Counter("c", "c", ["a", "b", "s"], registry=reg)
    child_h = Histogram("h", "h", ["a", "b"], registry=reg).labels("m", "w")
    hot_c = HotCounter(Counter("hc", "c", ["a", "b", "s"], registry=reg))
    hot_h = HotHistogram(Histogram("hh", "h", ["a", "b"], registry=reg))
    ids = itertools.count()
    prefix = os.urandom(8).hex()
    cached: dict[bytes, str] = {}
    key = b"Bearer sk-not-a-real-key-0123456789"

    def tenant_cached() -> str:
        t = cached.get(key)
        if t is None:
            t = cached[key] = hashlib.sha256(key).hexdigest()[:16]
        return t

    def noop() -> None:
        return None

    return [
        ("asyncio.current_task() (a getpid() each)", per_call_us(asyncio.current_task),
         "the task passed down from the caller", per_call_us(lambda: None)),
        ("os.urandom(16).hex() request id", per_call_us(lambda: os.urandom(16).hex().encode()),
         "process prefix + counter", per_call_us(lambda: f"{prefix}{next(ids):016x}".encode())),
        ("any(m in body for m in 4 media markers)",
         per_call_us(lambda: any(m in BODY for m in MARKERS)),
         "one compiled regex search", per_call_us(lambda: MARKER_RE.search(BODY))),
        ("loop.call_later(...).cancel() (body deadline; uvicorn's keep-alive)",
         await in_loop_us(lambda: loop.call_later(30, noop).cancel()),
         "no timer per request", 0.0),
        ("loop.call_at(...).cancel() (upstream read timer, before)",
         await in_loop_us(lambda: loop.call_at(loop.time() + 30, noop).cancel()),
         "one timer per connection", 0.0),
        ("asyncio.Event() per request (uvicorn)", per_call_us(asyncio.Event),
         "-", 0.0),
        ("cached prometheus child: .inc()", per_call_us(counter.labels("m", "w", "200").inc),
         "HotCounter.labels(...).inc()", per_call_us(lambda: hot_c.labels("m", "w", "200").inc())),
        ("cached prometheus child: .observe()",
         per_call_us(lambda: child_h.observe(0.0003)),
         "HotHistogram.labels(...).observe()",
         per_call_us(lambda: hot_h.labels("m", "w").observe(0.0003))),
        ("forward_headers(): dict of 13 client headers",
         per_call_us(lambda: {k.decode("latin-1"): v.decode("latin-1") for k, v in HEADERS
                              if k not in DROP}),
         "-", 0.0),
        ("tenant(): sha256 of the presented key",
         per_call_us(lambda: hashlib.sha256(key).hexdigest()[:16]),
         "cached per key", per_call_us(tenant_cached)),
        ("slots dataclass with a default_factory",
         per_call_us(lambda: _Attempt("/v1/chat/completions", BODY, False, "m", None)),
         "-", 0.0),
    ]  # fmt: skip


async def main() -> None:
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    for name, today, lean_name, lean in await rows():
        after = f"{lean_name}: {lean:5.2f} µs" if lean_name != "-" else ""
        print(f"{name:50s} {today:5.2f} µs   {after}")


if __name__ == "__main__":
    uvloop.run(main())
