"""The sleep and wake calls a swap group sends one member, and what each answer (or its
absence) says of the member: the level it sleeps at, whether a /sleep of ours may still be
running (``sleep_asked``), whether a wake of ours may have left it half awake (``wake_unsure``).
Each returns None once the call answered, else why not; ``group.py`` decides what follows."""

from __future__ import annotations

from gpupool.workers.swap import client
from gpupool.workers.swap.client import SleepCallFailed
from gpupool.workers.swap.member import GroupSeams, Member


async def ask_sleep(
    seams: GroupSeams, m: Member, wake_first: bool = False, keep: bool = False
) -> str | None:
    """POST /sleep at its level: None once it answered, else why not. ``wake_first``: a
    plain /wake_up before it (wakes whatever tags a failed wake left asleep, so that the
    /sleep frees them all: vLLM's /sleep does nothing while ``weights`` sleeps)."""
    w = m.worker
    assert w.url is not None
    if wake_first:
        try:
            await client.wake(seams.session, w.url, 1, seams.wake_timeout_s)
        except SleepCallFailed as e:
            return f"wake (to sleep again after a failed wake) failed: {e}"
    level, m.next_level = m.next_level or m.level, None
    try:
        await client.sleep(seams.session, w.url, level, seams.sleep_timeout_s, keep)
    except SleepCallFailed as e:
        m.sleep_asked = not m.launched  # (a launched one is restarted)
        return f"sleep failed: {e}"
    m.slept_at, m.sleep_asked, m.wake_unsure = level, False, False
    return None


async def send_wake(seams: GroupSeams, m: Member) -> str | None:
    """POST the wake for its sleep's level: None once it answered, else why not. A ``url:``
    member is ``wake_unsure`` from the call until an answer (a cancelled call included)."""
    w = m.worker
    assert w.url is not None
    m.wake_unsure = m.wake_unsure or not m.launched
    try:
        await client.wake(seams.session, w.url, m.slept_at or m.level, seams.wake_timeout_s)
    except SleepCallFailed as e:
        return f"wake failed: {e}"
    m.wake_unsure = False
    return None
