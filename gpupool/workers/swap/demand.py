"""The requests waiting for a slot, per model: what a swap group's policy reads.

The pipeline's ``Slots.take`` holds a :meth:`Demand.waiting` entry for as long as a request waits
(whatever ends the wait removes it), so the count is exact for this gateway. ``Slots`` also
records each admitted request's priority on its worker until it ends (:meth:`Demand.started`,
:meth:`Demand.finished`): requests a switch paused (``/sleep?mode=keep``) count as demand for
their model with the best of those. Nothing here does I/O.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelDemand:
    count: int
    oldest_s: float  # how long the oldest waiting request has waited
    best_priority: int  # the most urgent waiting request's priority (lower first, as vLLM's)
    total_age_s: float = 0.0  # every waiting request's age, summed (request-seconds)


class Demand:
    def __init__(self) -> None:
        self._waiting: dict[str, dict[int, tuple[float, int]]] = {}
        self._ids = itertools.count()
        self._running: dict[str, Counter[int]] = {}  # per worker: its requests' priorities

    @contextmanager
    def waiting(self, model: str, priority: int) -> Iterator[None]:
        entry = next(self._ids)
        mine = self._waiting.setdefault(model, {})
        mine[entry] = (time.monotonic(), priority)
        try:
            yield
        finally:
            mine.pop(entry, None)

    def count(self, model: str) -> int:
        return len(self._waiting.get(model, ()))

    def of(self, model: str, now: float | None = None) -> ModelDemand | None:
        entries = self._waiting.get(model)
        if not entries:
            return None
        now = time.monotonic() if now is None else now
        oldest = min(since for since, _ in entries.values())
        best = min(priority for _, priority in entries.values())
        total = sum(now - since for since, _ in entries.values())
        return ModelDemand(len(entries), now - oldest, best, total)

    def started(self, worker: str, priority: int) -> None:
        """A request of ``priority`` took a slot on ``worker``."""
        self._running.setdefault(worker, Counter())[priority] += 1

    def finished(self, worker: str, priority: int) -> None:
        """It ended (once per ``started``)."""
        mine = self._running.get(worker)
        if mine is None:
            return
        mine[priority] -= 1
        if mine[priority] <= 0:
            del mine[priority]
        if not mine:
            del self._running[worker]

    def best_running(self, worker: str) -> int:
        """The most urgent priority among ``worker``'s requests (0, the default, if none)."""
        mine = self._running.get(worker)
        return min(mine) if mine else 0
