"""A drain that lands while a health check of a ``url:`` worker is in flight stays: the check's
answer, taken before the drain, must not mark the worker ready again (the pool page's tests
saw 7 of 40 drains undone at a 20 ms check interval)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool.config.models import RoutingConfig
from gpupool.workers import remote
from gpupool.workers.probe import ProbeResult
from gpupool.workers.registry import Registry, Worker, WorkerState


@pytest.mark.parametrize("state", [WorkerState.draining, WorkerState.stopped])
async def test_a_drain_during_a_health_check_is_not_undone(
    monkeypatch: pytest.MonkeyPatch, state: WorkerState
) -> None:
    registry = Registry()
    w = Worker("w", "m", url="http://127.0.0.1:1", state=WorkerState.failed)
    registry.add(w)

    async def probe(*_args: Any) -> ProbeResult:
        registry.transition(w, state)  # the admin API drains it while the probe runs
        return ProbeResult(healthy=True, serves_model=True, max_model_len=4096)

    monkeypatch.setattr(remote, "probe", probe)
    poller = remote.RemotePoller(registry, None, RoutingConfig())  # type: ignore[arg-type]
    await poller.check(w)
    assert w.state is state
