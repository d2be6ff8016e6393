"""What a ``url:`` member of a swap group says of itself: asleep, awake and serving, or unknown.

gpupool did not launch a ``url:`` worker, so it cannot tell from a process whether the worker's
weights are on the GPU: only the worker can. ``/is_sleeping`` answering true is the one proof that
its GPU memory is free (but not after a wake of ours failed: vLLM says true while any tag sleeps,
weights awake or not; ``group.py`` sleeps such a member again first); a worker that serves
(``/health`` and ``/v1/models``, the poller's probe) without saying so counts as awake; anything
else is unknown, and an unknown member may hold the GPU (a ``/sleep`` that timed out may still be
running, an unreachable host may still have its weights loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import aiohttp

from gpupool.workers import probe as probes
from gpupool.workers.swap import client


class Seen(StrEnum):
    asleep = "asleep"
    awake = "awake"  # serving (its /is_sleeping said false, or nothing)
    unknown = "unknown"


@dataclass(frozen=True, slots=True)
class Reading:
    seen: Seen
    max_model_len: int | None = None
    error: str | None = None  # why it is unknown


async def read(session: aiohttp.ClientSession, url: str, model: str, timeout_s: float) -> Reading:
    if await client.is_sleeping(session, url, timeout_s):
        return Reading(Seen.asleep)
    result = await probes.probe(session, url, model, timeout_s)
    if not result.ready:
        return Reading(Seen.unknown, error=result.error)
    return Reading(Seen.awake, result.max_model_len)
