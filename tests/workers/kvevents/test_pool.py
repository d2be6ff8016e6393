"""A worker's index starts empty whenever its cache does: restart, sleep, wake, stop, failure.
Its first way up, and a drain and its resume (the process and its cache stay up), keep what was
learned; a new endpoint is a new subscription; a worker leaving the pool takes its own along."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupool.workers.kvevents.pool import KvPool
from gpupool.workers.kvevents.source import KvSource
from gpupool.workers.registry import Registry, Worker, WorkerState

S = WorkerState


def _worker(tmp: Path, n: int = 0) -> Worker:
    src = KvSource(f"ipc://{tmp}/pub{n}", f"ipc://{tmp}/replay{n}")
    return Worker("w", "m", url="http://w", kv_source=src)


@pytest.mark.parametrize(
    "path",
    [
        [S.ready, S.falling_asleep],
        [S.ready, S.falling_asleep, S.asleep, S.waking, S.ready],
        [S.ready, S.draining, S.stopped],  # a stop, or a `url:` worker's drain
        [S.ready, S.draining, S.starting, S.ready],  # resumed after its process ended
        [S.ready, S.failed],
        [S.ready, S.starting],  # a restart
    ],
)
async def test_the_index_empties_when_the_cache_does(
    tmp_path: Path, path: list[WorkerState]
) -> None:
    pool, registry, w = KvPool(), Registry(), _worker(tmp_path)
    registry.add(w)
    registry.on_change(pool.on_change)
    try:
        registry.transition(w, S.warming)
        index = pool.index("w")
        assert index is not None and pool.subscriber("w") is not None
        index.stored([1, 2])
        for state in path:
            registry.transition(w, state)
        assert len(index) == 0
    finally:
        await pool.aclose()
    assert pool.subscriber("w") is None


async def test_the_first_way_up_keeps_the_warm_up_blocks(tmp_path: Path) -> None:
    pool, registry, w = KvPool(), Registry(), _worker(tmp_path)
    registry.add(w)
    registry.on_change(pool.on_change)
    try:
        registry.transition(w, S.warming)
        index = pool.index("w")
        assert index is not None
        index.stored([1])
        registry.transition(w, S.ready)
        assert len(index) == 1
    finally:
        await pool.aclose()


async def test_a_new_endpoint_is_a_new_subscription(tmp_path: Path) -> None:
    pool, w = KvPool(), _worker(tmp_path)
    try:
        pool.watch(w)
        first = pool.subscriber("w")
        pool.watch(w)
        assert pool.subscriber("w") is first  # the same source: kept
        w.kv_source = KvSource(f"ipc://{tmp_path}/other")
        pool.watch(w)
        second = pool.subscriber("w")
        assert second is not first and first is not None
        first.join(timeout=5)
        assert not first.is_alive()  # the old thread ended
    finally:
        await pool.aclose()
    assert second is not None and not second.is_alive()


async def test_a_drain_and_its_resume_keep_the_index_and_its_subscription(tmp_path: Path) -> None:
    """A drained launched worker's vLLM keeps its cache (``Supervisor.drain``): the index keeps
    following its events while drained, and a resume finds it as warm as the cache."""
    pool, registry, w = KvPool(), Registry(), _worker(tmp_path)
    registry.add(w)
    registry.on_change(pool.on_change)
    try:
        registry.transition(w, S.ready)
        index, sub = pool.index("w"), pool.subscriber("w")
        assert index is not None and sub is not None
        index.stored([1, 2])
        registry.transition(w, S.draining)
        index.stored([3])  # what the drained worker still finishes
        registry.transition(w, S.ready)
        assert index.prefix_blocks([1, 2, 3]) == 3
        assert pool.subscriber("w") is sub and sub.is_alive()
    finally:
        await pool.aclose()


async def test_a_removed_worker_takes_its_subscription_and_index(tmp_path: Path) -> None:
    pool, registry, w = KvPool(), Registry(), _worker(tmp_path)
    registry.add(w)
    registry.on_change(pool.on_change)
    try:
        registry.transition(w, S.ready)
        sub = pool.subscriber("w")
        assert sub is not None
        pool.remove("w")
        assert pool.index("w") is None and pool.subscriber("w") is None
        sub.join(timeout=5)
        assert not sub.is_alive()  # its thread ended, its socket closed with it
    finally:
        await pool.aclose()
