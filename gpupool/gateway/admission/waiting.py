"""The wait loop both backends share: a grant, a deadline, and keep-alive callbacks between.

A backend resolves a future with the granted worker's name (or fails it, for example when its
store went away); this loop waits for that, calls ``on_wait(position)`` about every
``keepalive_s`` (the first call after one interval, so short waits send nothing), and gives up
at ``deadline``. It never cancels the future: the caller decides what a late grant means.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gpupool.gateway.admission.base import WaitCallback

PositionFn = Callable[[], Awaitable[int]]


async def wait_for_grant(
    fut: asyncio.Future[str],
    deadline: float,
    keepalive_s: float,
    position: PositionFn,
    on_wait: WaitCallback | None,
) -> str | None:
    """The granted worker, or None at ``deadline`` (loop time). A grant wins a tie."""
    loop = asyncio.get_running_loop()
    next_tick = loop.time() + keepalive_s
    while not fut.done():
        now = loop.time()
        if now >= deadline:
            return None
        if on_wait is not None and now >= next_tick:
            await on_wait(await position())
            next_tick = loop.time() + keepalive_s
            continue
        wake = deadline if on_wait is None else min(deadline, next_tick)
        await asyncio.wait((fut,), timeout=wake - now)
    return fut.result()


def consume(fut: asyncio.Future[str]) -> None:
    """Mark a failed future's exception as seen (no "never retrieved" log for abandoned ones)."""
    if fut.done() and not fut.cancelled():
        fut.exception()
