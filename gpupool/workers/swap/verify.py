"""What a swap group checks around a member's sleep and wake, so that it never trusts a 200:

- before a /sleep: the member's GPU memory is read (``memory.py``), and before its first level-2
  sleep its canary answer is recorded (``canary.py``: the worker is known good then);
- after the /sleep: its memory is read until it is seen freed (or cannot be seen);
- after a level-2 wake: the canary must give the recorded answer.

Each check returns None when all is well, else why not; ``group.py`` acts on it (a launched
worker is restarted, never woken beside; a ``url:`` one is put back to sleep). The outcome of the
last checks stays on the member's :class:`Verification` for the admin API.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp

from gpupool.workers.registry import Worker
from gpupool.workers.swap import canary
from gpupool.workers.swap.memory import Check, Freed, Watch

log = logging.getLogger("gpupool.swap")


@dataclass(slots=True)
class Verification:
    """One member's checks: its memory watch (launched members with a readable GPU; ``url:``
    ones where a launched member names the group's GPU), its recorded canary answer, and the
    last outcomes."""

    watch: Watch | None = None
    canary: str | None = None  # recorded before its first level-2 sleep
    last_sleep: Check | None = None
    last_canary: str | None = None  # "matched" or why not, after its last level-2 wake
    restarts: int = 0  # restarts (url: sleeps) these checks caused
    failure: str | None = None  # what the last of them found

    def view(self) -> dict[str, object]:
        """For ``/admin/workers``."""
        check = self.last_sleep
        return {
            "sleep_check": None if check is None else check.freed.value,
            "sleep_check_detail": None if check is None else check.describe(),
            "canary": self.last_canary,
            "verify_restarts": self.restarts,
            "verify_failure": self.failure,
        }


@dataclass(frozen=True, slots=True)
class Verifier:
    session: aiohttp.ClientSession
    canary_on: bool
    timeout_s: float  # a canary's answer

    async def before_sleep(self, w: Worker, v: Verification, level: int) -> int | None:
        """Record the canary if this is its first level-2 sleep; the memory it holds now."""
        if self.canary_on and level >= 2 and v.canary is None and w.url is not None:
            try:
                v.canary = await canary.ask(self.session, w.url, w.model, self.timeout_s)
            except canary.CanaryFailed as e:
                log.warning("worker %s: canary not recorded (%s): its level-2 wakes are "
                            "not checked until one is", w.name, e)  # fmt: skip
        return None if v.watch is None else await v.watch.read(w)

    async def after_sleep(self, w: Worker, v: Verification, awake: int | None) -> str | None:
        """None once its memory is seen freed (or cannot be seen); else why not."""
        if v.watch is None:
            return None
        check = v.last_sleep = await v.watch.until_freed(w, awake)
        if check.freed is not Freed.held:
            return None
        v.restarts += 1
        v.failure = v.watch.held(check)
        return v.failure

    async def after_wake(self, w: Worker, v: Verification, level: int) -> str | None:
        """None when the canary matches (or no level-2 wake, or none recorded); else why not."""
        if not self.canary_on or level < 2 or v.canary is None or w.url is None:
            return None
        try:
            got = await canary.ask(self.session, w.url, w.model, self.timeout_s)
        except canary.CanaryFailed as e:
            v.last_canary = str(e)
            v.failure = f"level-2 wake: {e}"
        else:
            if got == v.canary:
                v.last_canary = "matched"
                return None
            v.last_canary = f"answered {got[:40]!r}, not {v.canary[:40]!r}"
            v.failure = (
                f"level-2 wake answers the canary {got[:40]!r}, not {v.canary[:40]!r} as before "
                "its sleep: its weights did not reload right"
            )
        v.restarts += 1
        return v.failure
