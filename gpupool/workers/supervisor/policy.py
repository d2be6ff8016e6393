"""Restart policy: exponential backoff with jitter, and the crash window that gives up."""

from __future__ import annotations

from collections import deque

JITTER = 0.2


def backoff_delay(attempt: int, initial_s: float, max_s: float, jitter: float) -> float:
    """Delay before restart number ``attempt`` (0-based): ``initial_s * 2**attempt``, capped.

    ``jitter`` is a draw in [-1, 1]; it moves the delay by up to ±20 %, so workers that
    crashed together (one GPU fault, one bad driver) do not restart in lockstep. The jitter is
    applied after the cap, so a capped delay still varies.
    """
    base = min(initial_s * 2.0 ** min(attempt, 62), max_s)
    return max(0.0, base * (1.0 + JITTER * max(-1.0, min(1.0, jitter))))


class CrashWindow:
    """Crash times within the last ``window_s`` seconds; more than ``max_restarts`` → give up."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> int:
        """Record a crash at ``now``; return how many crashes the window holds."""
        self._times.append(now)
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times)

    def exhausted(self) -> bool:
        return len(self._times) > self.max_restarts

    def recent(self) -> int:
        return len(self._times)

    def clear(self) -> None:
        self._times.clear()
