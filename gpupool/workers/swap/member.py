"""A swap group's members and the seams it works through: what ``group.py``'s state machine
reads and changes (a member's sleep level, its doubts, its checks), and what it is handed
(registry, HTTP session, demand, events, supervisor restart, policy settings, timeouts)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.swap.demand import Demand
from gpupool.workers.swap.policy import Turns
from gpupool.workers.swap.verify import Verification, Verifier


def state_of(w: Worker) -> WorkerState:
    """``w.state`` now (it changes across awaits; a call keeps mypy from assuming otherwise)."""
    return w.state


class SwapEvents(Protocol):
    def switched(self, group: str, model: str, seconds: float, waited: int) -> None:
        """The GPU went to ``model`` after ``seconds``; ``waited`` requests were waiting."""
        ...

    def paused(self, group: str, model: str, requests: int) -> None:
        """A switch paused ``requests`` running requests of ``model`` (``/sleep?mode=keep``)."""
        ...


@dataclass(slots=True)
class Member:
    worker: Worker
    level: int
    idle_s: float | None
    launched: bool
    slept_at: int | None = None  # the level of its current sleep (an admin may pick another)
    next_level: int | None = None  # the level of its next sleep only (admin ``?level=``)
    sleep_asked: bool = False  # (url:) a /sleep of ours failed: it may still be falling asleep
    # (url:) a wake of ours failed or went unanswered: its "is_sleeping: true" is no proof (vLLM
    # says true while any tag sleeps: a level-2 wake that failed after ``tags=weights`` leaves the
    # weights on the GPU); only a /sleep of ours that answers (or a wake that does) clears it
    wake_unsure: bool = False
    verify: Verification = field(default_factory=Verification)  # its checks (``verify.py``)


@dataclass(frozen=True, slots=True)
class GroupSeams:
    registry: Registry
    session: aiohttp.ClientSession
    demand: Demand
    events: SwapEvents
    restart: Callable[[str], Awaitable[None]] | None  # the supervisor's, for launched workers
    turns: Turns
    sleep_timeout_s: float
    wake_timeout_s: float
    probe_timeout_s: float = 10.0
    tick_s: float = 0.1
    read_s: float = 2.0  # the pace of reads of a url: holder in doubt (the health interval)
    pause_after_s: float | None = None  # a switch pauses the holder's requests after this wait
    verifier: Verifier | None = None  # memory freed after a sleep, canary after a level-2 wake
