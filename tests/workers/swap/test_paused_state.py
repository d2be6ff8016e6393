"""A worker's pause (``paused_since``) ends however it leaves its sleep: a restart, a drain, a
failure as well as its group's wake. A pause left set on a worker that came back another way
would hold its streams' idle deadline forever (``held_since`` infinite) and show its running
requests as paused."""

from __future__ import annotations

import pytest

from gpupool.workers.registry import Worker, WorkerState


@pytest.mark.parametrize(
    "way", [WorkerState.starting, WorkerState.ready, WorkerState.draining, WorkerState.failed]
)
def test_leaving_sleep_any_way_ends_the_pause(way: WorkerState) -> None:
    w = Worker(name="w", model="m", url="http://127.0.0.1:9", swap_group="g")
    w.set_state(WorkerState.ready)
    w.inflight = 2
    w.set_state(WorkerState.falling_asleep)
    w.paused_since = 1.0
    for state in (WorkerState.asleep, WorkerState.waking):  # still asleep: still paused
        w.set_state(state)
        assert w.paused == 2 and w.held_since() == float("inf")
    w.set_state(way)
    assert w.paused == 0 and w.paused_since is None
    assert 0 < w.held_since() < float("inf")  # the idle deadline runs again from now
