"""How fast each worker has lately served this gateway's own requests. Pure: no I/O.

Load bands count requests, not what slows them: a worker that runs work the gateway did not
send (another replica's, a client going around the gateway, a long prompt hogging it) serves
the gateway's requests slower though its in-flight count looks like any other's, and vLLM's
scraped counts show such work only now and then (a request being tokenized is in neither its
running nor its waiting count). What the gateway sees itself is how long its requests took.

Each worker keeps, per size class, an exponentially weighted mean of seconds per unit of work
of the requests it completed, a unit being a prompt token or :data:`DECODE_UNITS` for an output
token, and a class a factor of four in prompt tokens and in output tokens. Workers are compared
only within a class: a request's fixed cost and the price of a decode step against a prompt
token differ by machine (CPU against GPU) and by batch, so a worker serving short requests next
to one serving long prompts would otherwise look slow or fast for its mix alone. A worker whose
figure is at least twice the best one in every class it shares with another worker is
:meth:`Pace.slow` by one band per doubling (of the smallest such ratio), at most
:data:`MAX_PENALTY`; a worker that shares no class with any other is not. A figure not
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
        # (worker, size class) -> [seconds per unit, when last refreshed]
        self._figures: dict[tuple[str, int], list[float]] = {}

    def observe(self, worker: str, seconds: float, prompt_tokens: int, output_tokens: int) -> None:
        """``worker`` served a request of that size in ``seconds`` (admission wait excluded)."""
        units = prompt_tokens + DECODE_UNITS * output_tokens
        if units <= 0 or seconds <= 0:
            return
        x, now = seconds / units, self._clock()
        # the size class: requests within a factor of four of each other in prompt and in
        # output tokens share one (inline, not a function: this runs once a request)
        key = (worker, (prompt_tokens.bit_length() >> 1) << 8 | output_tokens.bit_length() >> 1)
        fig = self._figures.get(key)
        if fig is None:
            self._figures[key] = [x, now]
            return
        if now - fig[1] < self._stale_s:
            x = fig[0] + self._alpha * (x - fig[0])  # a stale figure is replaced, not averaged
        fig[0], fig[1] = x, now

    def slow(self, workers: Sequence[Worker]) -> dict[str, int] | None:
        """Each slow worker's penalty in load bands; None when none is (the usual case)."""
        if len(workers) < 2 or not self._figures:
            return None
        fresh = self._fresh({w.name for w in workers})
        if len(fresh) < 2:
            return None
        best: dict[int, float] = {}
        seen: dict[int, int] = {}
        for classes in fresh.values():
            for c, x in classes.items():
                seen[c] = seen.get(c, 0) + 1
                if x < best.get(c, math.inf):
                    best[c] = x
        out: dict[str, int] | None = None
        for name, classes in fresh.items():
            ratio = min((x / best[c] for c, x in classes.items() if seen[c] > 1), default=1.0)
            if ratio < 2:
                continue
            if out is None:
                out = {}
            out[name] = min(MAX_PENALTY, int(math.log2(ratio)))
        return out

    def _fresh(self, names: set[str]) -> dict[str, dict[int, float]]:
        """Each of ``names``' figures not yet stale, by size class."""
        now, stale = self._clock(), self._stale_s
        out: dict[str, dict[int, float]] = {}
        for (name, c), (x, at) in self._figures.items():
            if name in names and now - at < stale:
                out.setdefault(name, {})[c] = x
        return out
