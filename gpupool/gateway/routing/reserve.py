"""Long-context capacity kept free while it is in demand. Pure: no I/O.

A pool of workers with different windows (a 96 GB card serving 128K tokens beside a 32 GB one
serving 16K) has one place for a long prompt and several for a short one. Load bands alone
spread short requests over every worker, so a long prompt that arrives finds the long-window
worker busy with work any worker could have done: its prefill shares the worker's steps and,
when the worker is full, waits for a slot. While prompts that only the larger windows hold have
come lately (``hold_s``), a request that fits a smaller window stays on a smaller-window worker
that has a free slot and is not slow, waiting or running outside work, even when a long-window
worker is less busy. When no long prompt came for ``hold_s``, every window serves short requests
by load, as before: capacity nobody needs long is not kept idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class WindowReserve:
    def __init__(self, hold_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        # model -> (until when, the smallest window that held one of its long prompts lately)
        self._held: dict[str, tuple[float, int]] = {}

    def saw_long(self, model: str, window: int) -> None:
        """A prompt of ``model`` that only windows of at least ``window`` tokens hold came."""
        if self.hold_s <= 0:
            return
        now = self._clock()
        held = self._held.get(model)
        if held is not None and held[0] > now:
            window = min(window, held[1])
        self._held[model] = (now + self.hold_s, window)

    def window(self, model: str) -> int | None:
        """The smallest window kept for long prompts of ``model`` now; None when none is."""
        held = self._held.get(model)
        if held is None:
            return None
        if held[0] <= self._clock():
            del self._held[model]
            return None
        return held[1]
