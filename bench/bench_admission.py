"""Admission overhead: what the queue adds to a request, per backend.

    .venv/bin/python bench/bench_admission.py [--iterations 5000] [--seconds 2] [--redis-url URL]

1. Added latency of ``acquire`` + ``release`` when a slot is free (p50 / p99, microseconds).
2. Throughput under saturation: capacity 2, 200 concurrent waiters each looping
   acquire -> release; grants per second (every grant here goes through the queue).

Without ``--redis-url`` a private ``redis-server`` is started on a free port (``--save ""``).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from gpupool.config.models import QueueBackend, QueueConfig
from gpupool.gateway.admission.base import Admission, Ticket
from gpupool.gateway.admission.factory import build_admission


class Workers:
    def __init__(self, **caps: int) -> None:
        self.caps = caps

    def capacity(self, worker: str) -> int:
        return self.caps.get(worker, 0)

    def available(self, worker: str) -> bool:
        return worker in self.caps

    def slots(self, worker: str) -> int:
        return self.caps.get(worker, 0)


def _ticket(n: int) -> Ticket:
    return Ticket(f"b{n}", "m", f"t{n % 4}", 0, ["w1"], max_wait_s=60.0)


@contextmanager
def private_redis() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen([*cmd, "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


Build = Callable[[int], Awaitable[Admission]]


def builder(backend: QueueBackend, url: str) -> Build:
    async def build(capacity: int) -> Admission:
        cfg = QueueConfig(
            backend=backend,
            redis_url=url,
            redis_prefix=f"bench-{uuid.uuid4().hex[:6]}",
            max_queued=10_000,
        )
        adm = build_admission(cfg, Workers(w1=capacity))
        await adm.start()
        return adm

    return build


async def latency(build: Build, iterations: int) -> tuple[float, float]:
    adm = await build(1_000_000)
    samples: list[float] = []
    try:
        for n in range(iterations + 200):
            t0 = time.perf_counter_ns()
            lease = await adm.acquire(_ticket(n))
            await adm.release(lease)
            if n >= 200:  # warm-up: connections, script loading
                samples.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        await adm.close()
    q = statistics.quantiles(samples, n=100)
    return q[49], q[98]


async def throughput(build: Build, seconds: float, waiters: int = 200) -> float:
    adm = await build(2)
    grants = 0
    stop = time.monotonic() + seconds

    async def loop(n: int) -> None:
        nonlocal grants
        while time.monotonic() < stop:
            lease = await adm.acquire(_ticket(n))
            grants += 1
            await adm.release(lease)

    try:
        began = time.monotonic()
        await asyncio.gather(*(loop(n) for n in range(waiters)))
        return grants / (time.monotonic() - began)
    finally:
        await adm.close()


async def run(args: argparse.Namespace, url: str) -> None:
    print(f"{'backend':<8} {'acquire+release p50':>20} {'p99':>10} {'saturated grants/s':>20}")
    for backend in (QueueBackend.memory, QueueBackend.redis):
        build = builder(backend, url)
        p50, p99 = await latency(build, args.iterations)
        rate = await throughput(build, args.seconds)
        print(f"{backend.value:<8} {p50:>17.1f} µs {p99:>7.1f} µs {rate:>20.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    if args.redis_url:
        asyncio.run(run(args, args.redis_url))
        return
    with private_redis() as url:
        asyncio.run(run(args, url))


if __name__ == "__main__":
    main()
