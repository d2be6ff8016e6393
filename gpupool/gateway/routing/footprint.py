"""How much each worker's prefix cache took in lately: the prompt tokens sent to it cold. Pure.

vLLM keeps a prompt's blocks cached until others evict them, so a conversation placed on a
worker stays cheap there as long as that worker's cache holds it. Load alone places new
conversations by who is less busy this instant; when several arrive together the load is equal,
and a fixed tie-break (the smallest window) would pile them on one worker, which then evicts
its own conversations while the other's cache sits empty. So on equal load a new prompt goes
where fewer new prompt tokens went lately, counted in bands of :data:`BAND_TOKENS` (a
conversation's opening is about one band) and halving every ``half_life_s``.

The half-life is short (10 s): the figure spreads the openings of one burst, and a cache under
load turns over within seconds, so what went in a minute ago says nothing of what it holds now.
At 60 s it did harm: a batch flood and one-shot prompts kept on the small window by the
long-window reserve left it some 40 bands ahead a minute later, and the next twelve
conversations all opened on the other worker, whose cache then held a third of them
(docs/performance.md, seventh pass).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

BAND_TOKENS = 1024


class Footprint:
    def __init__(self, half_life_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._rate = math.log(2) / half_life_s
        self._clock = clock
        self._tokens: dict[str, tuple[float, float]] = {}  # worker -> (tokens, as of)

    def add(self, worker: str, tokens: int) -> None:
        """``tokens`` of prompt the worker has not seen went to it."""
        now = self._clock()
        self._tokens[worker] = (self._at(worker, now) + tokens, now)

    def band(self, worker: str) -> int:
        return int(self._at(worker, self._clock()) // BAND_TOKENS)

    def _at(self, worker: str, now: float) -> float:
        held = self._tokens.get(worker)
        if held is None:
            return 0.0
        tokens, then = held
        return tokens * math.exp(-self._rate * (now - then))
