"""How fast each worker has lately served this gateway's own requests. Pure: no I/O.

Load bands count requests, not what slows them: a worker that runs work the gateway did not
send (another replica's, a client going around the gateway, a long prompt hogging it) serves
the gateway's requests slower though its in-flight count looks like any other's, and vLLM's
scraped counts show such work only now and then (a request being tokenized is in neither its
running nor its waiting count). What the gateway sees itself is how long its requests took.

Each worker keeps an exponentially weighted mean of seconds per unit of work of the requests it
completed, a unit being a prompt token or :data:`DECODE_UNITS` for an output token (a decode
step costs about as much as that many prompt tokens of prefill), so that a worker serving the
long prompts is not taken for a slow one. A worker whose figure is at least twice the pool's
best is :meth:`Pace.slow` by one band per doubling, at most :data:`MAX_PENALTY`. A figure not
refreshed for ``stale_s`` counts no more: a worker that got nothing because it was slow is
tried again then, so a penalty never outlives its cause by more than that.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from gpupool.workers.registry import Worker

DECODE_UNITS = 64
MAX_PENALTY = 3


class Pace:
    def __init__(
        self,
        alpha: float = 0.3,
        stale_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._alpha = alpha
        self._stale_s = stale_s
        self._clock = clock
        self._per_unit: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def observe(self, worker: str, seconds: float, prompt_tokens: int, output_tokens: int) -> None:
        """``worker`` served a request of that size in ``seconds`` (admission wait excluded)."""
        units = prompt_tokens + DECODE_UNITS * output_tokens
        if units <= 0 or seconds <= 0:
            return
        x = seconds / units
        old, now = self._per_unit.get(worker), self._clock()
        if old is not None and now - self._at[worker] < self._stale_s:
            x = old + self._alpha * (x - old)  # a stale figure is replaced, not averaged
        self._per_unit[worker] = x
        self._at[worker] = now

    def slow(self, workers: Sequence[Worker]) -> dict[str, int] | None:
        """Each slow worker's penalty in load bands; None when none is (the usual case)."""
        if len(workers) < 2 or not self._per_unit:
            return None
        now, stale = self._clock(), self._stale_s
        best = math.inf
        for w in workers:
            x = self._per_unit.get(w.name)
            if x is not None and now - self._at[w.name] < stale and x < best:
                best = x
        out: dict[str, int] | None = None
        for w in workers:
            x = self._per_unit.get(w.name)
            if x is None or x < 2 * best or now - self._at[w.name] >= stale:
                continue
            if out is None:
                out = {}
            out[w.name] = min(MAX_PENALTY, int(math.log2(x / best)))
        return out
