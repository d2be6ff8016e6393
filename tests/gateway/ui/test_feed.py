"""The pool page's feed without HTTP: what a snapshot holds, and that its histories stay bounded."""

from __future__ import annotations

import asyncio
import logging

import orjson

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.services import build_services
from gpupool.gateway.ui.feed import (
    HISTORY_S,
    MAX_ERRORS,
    SAMPLE_S,
    ErrorLog,
    PoolFeed,
    Sampler,
    gpu_rows,
)
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.registry import Worker, WorkerState

GIB = 2**30


def test_sampler_turns_counters_into_rates_and_forgets_old_points() -> None:
    s = Sampler()
    s.add({"w1": 100.0}, now=0.0, at_ms=0)
    s.add({"w1": 200.0}, now=5.0, at_ms=5000)
    s.add({"w1": 200.0, "w2": 50.0}, now=10.0, at_ms=10000)  # w2 appears: no rate from nothing
    assert s.series("w1") == [(5000, 20.0), (10000, 0.0)]
    assert s.series("w2") == [(10000, 0.0)]
    for i in range(3, 500):
        s.add({"w1": 200.0 + i}, now=5.0 * i, at_ms=5000 * i)
    assert len(s.series("w1")) == int(HISTORY_S / SAMPLE_S) + 1


def test_error_log_keeps_the_last_errors_with_their_request_ids() -> None:
    log = logging.getLogger("gpupool.test-ui-feed")
    handler = ErrorLog(lambda: "rid-42")
    log.addHandler(handler)
    try:
        log.info("not an error")
        for i in range(MAX_ERRORS + 10):
            log.error("failure %d", i)
    finally:
        log.removeHandler(handler)
    entries = list(handler.entries)
    assert len(entries) == MAX_ERRORS
    assert entries[-1]["message"] == f"failure {MAX_ERRORS + 9}"
    assert {e["request_id"] for e in entries} == {"rid-42"}
    assert all(e["level"] in ("warning", "error") for e in entries)


def test_gpus_without_nvml_are_listed_with_memory_unknown() -> None:
    workers = [Worker("a", "m", gpus=[0, 1]), Worker("b", "m", gpus=[1]), Worker("c", "m")]
    rows = gpu_rows(None, workers)
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[1]["workers"] == ["a", "b"] and rows[1]["memory_total_bytes"] is None
    card = GpuInfo(0, "NVIDIA H200", 141 * GIB, 41 * GIB, (9, 0), "GPU-x")
    rows = gpu_rows([card], workers)
    assert rows[0]["memory_used_bytes"] == 100 * GIB and rows[0]["name"] == "NVIDIA H200"
    assert rows[1]["memory_total_bytes"] is None  # NVML does not see GPU 1 here


def _cfg() -> GpupoolConfig:
    return GpupoolConfig.model_validate({
        "models": [{"name": "m"}],
        "workers": [{"name": "w1", "model": "m", "url": "http://127.0.0.1:9"}],
    })  # fmt: skip


def test_snapshot_holds_workers_queues_changes_and_reloads() -> None:
    async def main() -> None:
        svc = build_services(_cfg())
        feed = PoolFeed.attach(svc, lambda: "")
        try:
            waiting = feed.changed
            w = svc.registry.get("w1")
            assert w is not None
            svc.registry.transition(w, WorkerState.ready)
            assert waiting.is_set() and not feed.changed.is_set()  # streams woken, once
            svc.registry.transition(w, WorkerState.draining)
            feed.on_reload(_cfg())
            snap = await feed.snapshot()
        finally:
            await feed.close()
            await svc.close()
        (row,) = snap["workers"]
        assert row["name"] == "w1" and row["state"] == "draining" and row["capacity"] > 0
        assert snap["queues"] == [{"model": "m", "depth": 0, "oldest_wait_s": 0.0,
                                   "rejected_last_min": 0}]  # fmt: skip
        assert [(c["from"], c["to"]) for c in snap["changes"]] == [
            ("ready", "draining"), ("starting", "ready")]  # fmt: skip
        assert snap["reloads"][0]["workers"] == 1
        assert feed.errors not in logging.getLogger("gpupool").handlers  # closed: unhooked
        assert feed.on_reload not in svc.reload_hooks

    asyncio.run(main())


def test_a_pool_of_thousands_gives_a_bounded_snapshot() -> None:
    """Issue 35: 4,000 discovered workers made every snapshot 1.1-1.5 MB, every 2 s."""
    from gpupool.gateway.ui.feed import MAX_WORKER_ROWS, shown_workers

    workers = [Worker(f"w{i}", "m") for i in range(4000)]
    for w in workers[:3990]:
        w.state = WorkerState.ready
    workers[2000].state = WorkerState.failed
    shown, hidden = shown_workers(workers)
    assert len(shown) == MAX_WORKER_ROWS
    assert {w.name for w in shown if w.state is not WorkerState.ready} == {
        "w2000", *(f"w{i}" for i in range(3990, 4000))}  # fmt: skip
    assert [w.name for w in shown] == sorted((w.name for w in shown), key=lambda n: int(n[1:]))
    assert hidden == {"ready": 4000 - MAX_WORKER_ROWS}
    assert shown_workers(workers[:5]) == (workers[:5], {})

    async def main() -> None:
        cfg = GpupoolConfig.model_validate({
            "models": [{"name": "m"}],
            "workers": [{"name": f"w{i}", "model": "m", "url": f"http://127.0.0.1:{i + 1}"}
                        for i in range(1000)],
        })  # fmt: skip
        svc = build_services(cfg)
        feed = PoolFeed.attach(svc, lambda: "")
        try:
            snap = await feed.snapshot()
        finally:
            await feed.close()
            await svc.close()
        assert len(snap["workers"]) == MAX_WORKER_ROWS and snap["workers_total"] == 1000
        assert snap["workers_hidden"] == {"starting": 1000 - MAX_WORKER_ROWS}
        assert len(orjson.dumps(snap)) < 200_000

    asyncio.run(main())
