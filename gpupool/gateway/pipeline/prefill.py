"""One long prefill at a time per worker: a long prompt waits for the one before it.

vLLM's chunked prefill fills each step's token budget (``--max-num-batched-tokens``) first with
the running requests, then with new ones. A long prompt that arrives while another is being
prefilled on the same worker takes the rest of every step from it: the first one's last chunk
runs in a full step instead of a short one, so its first token comes later by up to a step's
time (on a CPU worker with a 2,048-token budget: 1.3 s alone, 1.9 s with a second 2,600-token
prompt sent 0.2 s after it), and the second one gains nothing in exchange (2.6 s from the first
one's start either way). Prefilling them one after the other gives the first its own time and
the second the same.

So a streamed request whose prompt holds at least ``min_tokens`` (the workers' batch budget)
waits, holding its slot, until this gateway's long prefill before it on that worker has sent
its first event or ended, at most ``max_wait_s``. Its own turn ends at its first event, at an
error, at a retry elsewhere, or when its exchange closes, whichever comes first. Requests below
``min_tokens`` and whole-body requests (whose first token the gateway cannot see) neither wait
nor hold. Each replica gates its own requests.
"""

from __future__ import annotations

import asyncio
import contextlib


class Turn:
    """A long prefill's hold on its worker; :meth:`end` lets the next one in (idempotent)."""

    __slots__ = ("_done", "_gate", "worker")

    def __init__(self, gate: PrefillGate, worker: str) -> None:
        self._gate = gate
        self.worker = worker
        self._done = asyncio.Event()

    def end(self) -> None:
        if self._done.is_set():
            return
        self._done.set()
        self._gate._ended(self)


class PrefillGate:
    def __init__(self, min_tokens: int, max_wait_s: float) -> None:
        self.min_tokens = min_tokens
        self._max_wait_s = max_wait_s
        self._turns: dict[str, Turn] = {}  # worker -> the long prefill running on it

    async def enter(self, worker: str) -> Turn:
        """Wait for the worker's long prefill before this one, then hold the worker.
        Cancelled while waiting, it holds nothing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._max_wait_s
        while (ahead := self._turns.get(worker)) is not None:
            left = deadline - loop.time()
            if left <= 0:
                break  # the one ahead is stuck (or very long): go beside it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ahead._done.wait(), left)
        turn = self._turns[worker] = Turn(self, worker)
        return turn

    def configure(self, min_tokens: int, max_wait_s: float) -> None:
        """A reload's settings, for the turns that start from now."""
        self.min_tokens = min_tokens
        self._max_wait_s = max_wait_s

    def held(self) -> int:
        """Workers with a long prefill running (0 once every turn has ended)."""
        return len(self._turns)

    def _ended(self, turn: Turn) -> None:
        if self._turns.get(turn.worker) is turn:
            del self._turns[turn.worker]
