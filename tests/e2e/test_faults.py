"""Faults injected into a running pool: real `gpupool serve` gateways, simulated workers and
`redis-server` processes that the tests kill, freeze, slow down and overload.

Every scenario checks the same four things and prints one ``FAULT-RESULT`` line (``pytest -s``):
what the clients saw (labels from ``support/fault_tools.py``), that no request was executed twice
(``request_ids`` over all workers), that none was lost without an error, and that capacity came
back (a new request succeeds; no in-flight count or held slot remains), with how long that took.
``docs/reliability.md`` holds the numbers of one run.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.fault_tools import (
    MODEL,
    Outcome,
    async_client,
    body,
    call,
    call_and_leave,
    duplicates,
    executed,
    fresh_request,
    gateway_config,
    labels,
    queue_depth,
    raise_fd_limit,
    report,
    rid,
    settled,
    sim_stats,
    wait_state,
    wait_until,
    workers,
)
from tests.support.procs import Proc, gateway, redis_server, running, sim

# timing: how soon a fault is seen and a worker is back is bounded (each bound says its slack)
pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(180)]

NO_AFFINITY = {"prefix_affinity": False}


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)


async def _concurrent(
    url: str, n: int, prefix: str, headers: dict[str, str] | None = None
) -> list[Outcome]:
    """``n`` requests at once, every other one streaming."""
    async with async_client(n) as c:
        return await asyncio.gather(
            *(
                call(c, url, body(f"{prefix} {i}", stream=i % 2 == 1), rid(prefix), headers)
                for i in range(n)
            )
        )


async def _sequential(url: str, n: int, prefix: str) -> list[Outcome]:
    async with async_client(1) as c:
        return [
            await call(c, url, body(f"{prefix} {i}", stream=i % 2 == 1), rid(prefix))
            for i in range(n)
        ]


def _assert_nothing_lost(outcomes: list[Outcome], allowed: set[str]) -> None:
    seen = labels(outcomes)
    lost = [o for o in outcomes if o.lost]
    assert not lost, f"lost without an error: {[(o.rid, o.label, o.detail) for o in lost]}"
    assert set(seen) <= allowed, seen


# ---- a worker killed (SIGKILL) ------------------------------------------------------------------


def test_worker_killed_while_idle(tmp_path: Path) -> None:
    a, b = (sim(model=MODEL, tmp=tmp_path, max_num_seqs=8) for _ in range(2))
    gw = gateway(gateway_config([("a", a, 4), ("b", b, 4)], routing=NO_AFFINITY), tmp_path)
    with running(a, b), running(gw, ready_path="/ready"):
        # held 0.3 s each, so the eight overlap however slowly a busy machine sends them
        warm = asyncio.run(_concurrent(gw.url, 8, "warm", {"x-sim-hold-ms": "300"}))
        assert {o.worker for o in warm} == {"a", "b"}, "both workers should have served"
        before = executed(a)
        a.kill()
        t0 = time.monotonic()
        after = asyncio.run(_sequential(gw.url, 20, "after-kill"))
        wait_state(gw, "a", "failed")
        out_s = _since(t0)
        recovery = settled([gw], [b])
        fresh = fresh_request(gw)
        ids = before + executed(b)
        report(
            "worker kill -9, idle",
            clients=labels(after),
            workers_after=Counter(o.worker for o in after),
            duplicates=len(duplicates(ids)),
            first_request_s=round(after[0].elapsed_s, 3),
            marked_out_s=out_s,
            settle_s=round(recovery, 2),
            fresh=fresh.label,
        )
        _assert_nothing_lost(after, {"200"})
        assert {o.worker for o in after} == {"b"}
        assert workers(gw)["a"]["state"] == "failed" and workers(gw)["a"]["last_error"]
        assert not duplicates(ids)
        assert fresh.label == "200"


@pytest.mark.parametrize("migrations", [0, 2])
def test_worker_killed_mid_stream(tmp_path: Path, migrations: int) -> None:
    """With migrations (the default) the victim's streams go on on the other worker (issue
    36, ``tests/gateway/test_migration.py``); without, each ends with its error event."""
    victim = sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, itl_ms=100, output_tokens=200)
    other = sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, itl_ms=30, output_tokens=200)
    routing = {**NO_AFFINITY, "migrations": migrations}
    cfg = gateway_config([("victim", victim, 4), ("other", other, 4)], routing=routing)
    gw = gateway(cfg, tmp_path)
    with running(victim, other), running(gw, ready_path="/ready"):

        async def scenario() -> tuple[list[Outcome], list[str], float, float]:
            async with async_client(8) as c:
                tasks = [
                    asyncio.create_task(
                        call(c, gw.url, body(f"s{i}", max_tokens=60, stream=True), rid("mid"))
                    )
                    for i in range(8)
                ]
                await asyncio.to_thread(
                    wait_until,
                    "both workers streaming 4",
                    lambda: sim_stats(victim)["running"] == 4 == sim_stats(other)["running"],
                    15,
                )
                await asyncio.sleep(0.3)  # some tokens went out on every stream
                ids = executed(victim)
                victim.kill()
                t_kill = time.monotonic()
                await asyncio.to_thread(wait_state, gw, "victim", "failed")
                out_s = _since(t_kill)
                return await asyncio.gather(*tasks), ids, t_kill, out_s

        outcomes, victim_ids, t_kill, out_s = asyncio.run(scenario())
        recovery = settled([gw], [other])
        fresh = fresh_request(gw, stream=True)
        by_worker = {w: labels(o for o in outcomes if o.worker == w) for w in ("victim", "other")}
        ids = victim_ids + executed(other)
        told_s = max(o.ended for o in outcomes if o.worker == "victim") - t_kill
        report(
            f"worker kill -9, mid-stream (migrations: {migrations})",
            clients=by_worker,
            duplicates=len(duplicates(ids)),
            error_event_after_kill_s=round(told_s, 3),
            marked_out_s=out_s,
            settle_s=round(recovery, 2),
            fresh=fresh.label,
        )
        _assert_nothing_lost(outcomes, {"200", "200+error-event"})
        victims = {"200": 4} if migrations else {"200+error-event": 4}
        assert by_worker == {"victim": victims, "other": {"200": 4}}
        assert not duplicates(ids)  # a continuation's worker request id is ``<id>-m1``
        assert fresh.label == "200" and fresh.worker == "other"


# ---- a worker frozen (SIGSTOP), then thawed -----------------------------------------------------
# One run, several verdicts: the run happens once (module fixture), each property is a test.

HEALTH_TIMEOUT_S = 2.0


@dataclass
class Freeze:
    during: list[Outcome]  # clients that arrived while the worker was frozen and still in
    while_out: list[Outcome]  # clients that arrived once it was out
    out_s: float  # freeze -> marked out
    back_s: float  # SIGCONT -> ready again


def _freeze(a: Proc, gw: Proc, traffic: bool) -> Freeze:
    """Freeze ``a``; with ``traffic``, 12 clients arrive at once. Until ``a`` is out, then thaw."""
    a.kill(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        during = asyncio.run(_concurrent(gw.url, 12, "frozen")) if traffic else []
        wait_state(gw, "a", "failed", timeout=30)
        out_s = _since(t0)
        while_out = asyncio.run(_sequential(gw.url, 6, "while-out"))
    finally:
        a.kill(signal.SIGCONT)
    t1 = time.monotonic()
    wait_state(gw, "a", "ready", timeout=30)
    return Freeze(during, while_out, out_s, _since(t1))


@dataclass
class FrozenRun:
    quiet: Freeze  # no traffic: only the health check can notice
    busy: Freeze  # 12 clients: their read timeouts notice first
    fresh: Outcome
    duplicates: dict[str, int]
    inflight: list[int]


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> FrozenRun:
    tmp = tmp_path_factory.mktemp("frozen")
    a, b = (sim(model=MODEL, tmp=tmp, max_num_seqs=16, ttft_ms=20) for _ in range(2))
    server = {"upstream_read_timeout_s": 2.0, "upstream_total_timeout_s": 2.0,
              "upstream_connect_timeout_s": 1.0}  # fmt: skip
    routing = {**NO_AFFINITY, "health_timeout_s": HEALTH_TIMEOUT_S}
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing=routing, server=server)
    gw = gateway(cfg, tmp)
    with running(a, b), running(gw, ready_path="/ready"):
        quiet = _freeze(a, gw, traffic=False)
        busy = _freeze(a, gw, traffic=True)
        recovery = settled([gw], [a, b])
        fresh = fresh_request(gw)
        ids = executed(a, b)
        inflight = [w["inflight"] for w in workers(gw).values()]
    run = FrozenRun(quiet, busy, fresh, duplicates(ids), inflight)
    report(
        "worker frozen (SIGSTOP), then SIGCONT",
        clients=labels(busy.during),
        slowest_s=round(max(o.elapsed_s for o in busy.during), 2),
        while_out=labels(quiet.while_out + busy.while_out),
        out_by_health_check_s=quiet.out_s,
        out_under_traffic_s=busy.out_s,
        back_after_sigcont_s=[quiet.back_s, busy.back_s],
        settle_s=round(recovery, 2),
        duplicates=len(run.duplicates),
        fresh=fresh.label,
    )
    return run


def test_frozen_worker_requests_end_with_an_error_not_a_retry(frozen: FrozenRun) -> None:
    """A request the frozen worker received ends in time: at the read deadline (or when the
    worker is taken out) it moves to the healthy worker (request migration, issue 36: its
    worker request id there is ``<id>-m1``, so it is not "executed twice" by id) or, where it
    cannot, gets a 502. Requests on the healthy worker succeed."""
    during = frozen.busy.during
    _assert_nothing_lost(during, {"200", "502"})
    assert "200" in labels(during)
    assert max(o.elapsed_s for o in during) < 2.0 + 5.0  # the read timeout, slack
    assert frozen.fresh.label == "200" and frozen.inflight == [0, 0]


def test_frozen_worker_is_taken_out_and_comes_back(frozen: FrozenRun) -> None:
    for run in (frozen.quiet, frozen.busy):
        assert {o.worker for o in run.while_out} == {"b"}
        assert labels(run.while_out) == {"200": 6}
        assert run.back_s < 5.0
    # fail_threshold (2) probes that time out, each after a health interval, plus slack
    assert frozen.quiet.out_s < 2 * (HEALTH_TIMEOUT_S + 0.2) + 3.0
    assert frozen.busy.out_s < 2.0 + 3.0  # the retries' failures count too


def test_frozen_worker_requests_are_not_executed_twice(frozen: FrozenRun) -> None:
    assert not frozen.duplicates


def test_request_on_a_frozen_worker_ends_once_the_worker_is_out(tmp_path: Path) -> None:
    a, b = (sim(model=MODEL, tmp=tmp_path, max_num_seqs=16) for _ in range(2))
    routing = {**NO_AFFINITY, "fail_threshold": 1, "health_timeout_s": HEALTH_TIMEOUT_S}
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing=routing)
    gw = gateway(cfg, tmp_path)  # the default upstream_read_timeout_s: vLLM may be silent long
    with running(a, b), running(gw, ready_path="/ready"):
        a.kill(signal.SIGSTOP)
        t0 = time.monotonic()

        async def stuck() -> tuple[Outcome, float]:
            async with async_client(1, timeout=7) as c:  # the worker is out after ~2 s
                out = asyncio.create_task(call(c, gw.url, body("to a"), rid("stuck")))
                await asyncio.to_thread(wait_state, gw, "a", "failed", 10)
                out_s = _since(t0)
                return await out, out_s

        try:
            out, out_s = asyncio.run(stuck())
        finally:
            a.kill(signal.SIGCONT)  # else the gateway's shutdown waits for the stuck request
        report(
            "request in flight on a frozen worker",
            client=out.label,
            elapsed_s=round(out.elapsed_s, 2),
            worker_out_s=out_s,
        )
        assert out.label in {"200", "502", "503"}, out


# ---- a worker slow to start ---------------------------------------------------------------------


def test_worker_slow_to_start(tmp_path: Path) -> None:
    delay = 4.0
    slow = sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, startup_delay_s=delay)
    gw = gateway(gateway_config([("slow", slow, 4)]), tmp_path)
    # the gateway first, then the worker: a gateway slow to start on a loaded machine (4 s and
    # more beside two CPU burners) would otherwise find the worker ready already
    with running(gw, ready_path="/health"):
        slow.start()
        t0 = time.monotonic()
        try:
            r = httpx.get(gw.url + "/ready", timeout=5)
            assert r.status_code == 503 and r.json()["missing_models"] == [MODEL]

            async def scenario() -> tuple[list[Outcome], list[Outcome]]:
                patient = _concurrent(gw.url, 6, "patient", {"x-gpupool-max-wait": "20"})
                hasty = _concurrent(gw.url, 2, "hasty", {"x-gpupool-max-wait": "0.5"})
                return await asyncio.gather(patient, hasty)

            patient, hasty = asyncio.run(scenario())
            wait_until("/ready 200", lambda: httpx.get(gw.url + "/ready").status_code == 200, 10)
            ready_s = _since(t0)
            recovery = settled([gw], [slow])
            fresh = fresh_request(gw)
            ids = executed(slow)
            report(
                "worker slow to start (startup_delay_s=4)",
                queued_clients=labels(patient),
                impatient_clients=labels(hasty),
                ready_after_start_s=ready_s,
                queued_waited_s=round(max(o.elapsed_s for o in patient), 2),
                duplicates=len(duplicates(ids)),
                settle_s=round(recovery, 2),
                fresh=fresh.label,
            )
            _assert_nothing_lost(patient + hasty, {"200", "429"})
            assert labels(patient) == {"200": 6}
            # refused after 0.5 s: a real 429 with Retry-After, for the stream too (a stream
            # is not committed to 200 while it waits, unless it asks for queue events)
            assert labels(hasty) == {"429": 2}
            assert delay - 1 < ready_s < delay + 10
            assert not duplicates(ids) and len(ids) == 6 + 1  # + the fresh one
            assert fresh.label == "200"
        finally:
            slow.stop()


# ---- Redis killed and restarted under load ------------------------------------------------------


async def _load_until(url: str, stop: asyncio.Event, loops: int, prefix: str) -> list[Outcome]:
    """``loops`` clients sending one request after another until ``stop`` (at most 300 each)."""
    async with async_client(loops) as c:

        async def loop(k: int) -> list[Outcome]:
            outs: list[Outcome] = []
            for i in range(300):
                if stop.is_set():
                    break
                outs.append(
                    await call(c, url, body(f"{prefix}{k}-{i}", stream=i % 2 == 1), rid(prefix))
                )
            return outs

        per_loop = await asyncio.gather(*(loop(k) for k in range(loops)))
    return [o for outs in per_loop for o in outs]


def test_redis_killed_and_restarted_under_load(tmp_path: Path) -> None:
    redis = redis_server(tmp_path)
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=64, ttft_ms=50)
    queue = {
        "backend": "redis",
        "redis_url": redis.url,
        "lease_ttl_s": 2.0,
        "on_redis_down": "local",
        "replicas_hint": 1,
    }
    gw = gateway(gateway_config([("w", w, 2)], queue=queue), tmp_path)
    redis2 = Proc(redis.argv, redis.url, tmp_path / "redis-again.log")
    with running(redis, ready_path=""), running(w), running(gw, ready_path="/ready"):
        try:

            async def scenario() -> tuple[list[Outcome], dict[str, float], tuple[float, float]]:
                stop = asyncio.Event()
                load = asyncio.create_task(_load_until(gw.url, stop, 6, "r"))
                await asyncio.sleep(1.5)
                redis.kill()
                t_kill = time.monotonic()
                await asyncio.to_thread(wait_until, "redis_up false", lambda: not _redis_up(gw), 10)
                down_s = _since(t_kill)
                await asyncio.sleep(2.0)
                redis2.start()
                t_restart = time.monotonic()
                await asyncio.to_thread(wait_until, "redis_up true", lambda: _redis_up(gw), 15)
                up_s = _since(t_restart)
                await asyncio.sleep(1.5)
                stop.set()
                times = {"noticed_down_s": down_s, "back_on_redis_s": up_s}
                return await load, times, (t_kill, t_restart)

            outcomes, times, (t_kill, t_restart) = asyncio.run(scenario())
            in_outage = [o for o in outcomes if t_kill < o.ended < t_restart]
            recovery = settled([gw], [w])
            fresh = fresh_request(gw)
            ids, peak = executed(w), sim_stats(w)["peak_running"]
            report(
                "Redis killed and restarted (on_redis_down: local)",
                clients=labels(outcomes),
                served_while_redis_down=labels(in_outage),
                slowest_s=round(max(o.elapsed_s for o in outcomes), 2),
                peak_running=peak,
                duplicates=len(duplicates(ids)),
                settle_s=round(recovery, 2),
                fresh=fresh.label,
                **times,
            )
            _assert_nothing_lost(outcomes, {"200"})
            assert len(in_outage) > 20  # the local fallback served while Redis was gone
            assert peak <= 2
            assert not duplicates(ids) and len(ids) == len(outcomes) + 1  # + the fresh one
            assert fresh.label == "200" and _redis_up(gw)
        finally:
            redis2.stop()


def _redis_up(gw: Proc) -> bool:
    return bool(httpx.get(gw.url + "/admin/queue", timeout=5).json()["redis_up"])


# ---- a gateway replica killed while it holds slots ----------------------------------------------


def test_replica_killed_while_holding_slots(tmp_path: Path) -> None:
    redis = redis_server(tmp_path)
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=64, ttft_ms=20, itl_ms=200, output_tokens=200)
    ttl = 2.0
    queue = {"backend": "redis", "redis_url": redis.url, "lease_ttl_s": ttl}
    cfg = gateway_config([("w", w, 2)], queue=queue)
    a, b = gateway(cfg, tmp_path), gateway(cfg, tmp_path)
    with running(redis, ready_path=""), running(w), running(a, b, ready_path="/ready"):

        async def scenario() -> tuple[list[Outcome], list[Outcome], float]:
            async with async_client(8, 30) as c:
                holders = [
                    asyncio.create_task(
                        call(c, a.url, body(f"hold{i}", max_tokens=100, stream=True), rid("on-a"))
                    )
                    for i in range(2)
                ]
                await asyncio.to_thread(
                    wait_until, "a holds both slots", lambda: sim_stats(w)["running"] == 2, 10
                )
                waiting = [
                    asyncio.create_task(call(c, b.url, body(f"b{i}"), rid("on-b")))
                    for i in range(3)
                ]
                await asyncio.to_thread(
                    wait_until, "3 queued on b", lambda: queue_depth(b) == 3, 10
                )
                a.kill()
                t_kill = time.monotonic()
                return await asyncio.gather(*holders), await asyncio.gather(*waiting), t_kill

        held, queued, t_kill = asyncio.run(scenario())
        back_s = round(min(o.ended for o in queued) - t_kill, 2)
        recovery = settled([b], [w])
        fresh = fresh_request(b)
        ids, peak = executed(w), sim_stats(w)["peak_running"]
        report(
            "gateway replica kill -9 holding slots (lease_ttl_s=2)",
            killed_replica_clients=labels(held),
            other_replica_clients=labels(queued),
            capacity_back_after_kill_s=back_s,
            peak_running=peak,
            queued_waited_max_s=round(max(o.elapsed_s for o in queued), 2),
            duplicates=len(duplicates(ids)),
            settle_s=round(recovery, 2),
            fresh=fresh.label,
        )
        assert labels(held) == {"conn-cut": 2}  # their gateway died: a transport error
        _assert_nothing_lost(queued, {"200"})
        assert peak <= 2
        assert back_s < ttl + 3.0
        assert not duplicates(ids)
        assert fresh.label == "200"


# ---- 1,000 clients leaving mid-stream ----------------------------------------------------------


def test_thousand_clients_disconnect_mid_stream(tmp_path: Path) -> None:
    n = 1000
    raise_fd_limit(16384)  # the gateway needs ~2 fds per stream; children inherit the limit
    s1, s2 = (
        sim(model=MODEL, tmp=tmp_path, max_num_seqs=600, ttft_ms=20, itl_ms=250, output_tokens=400)
        for _ in range(2)
    )
    cfg = gateway_config([("s1", s1, 600), ("s2", s2, 600)], queue={"max_queued": 2000})
    gw = gateway(cfg, tmp_path)
    with running(s1, s2), running(gw, ready_path="/ready"):

        async def scenario() -> list[Outcome]:
            async with async_client(n, 90) as c:
                return await asyncio.gather(
                    *(
                        call_and_leave(
                            c, gw.url, body(f"d{i}", max_tokens=300, stream=True), rid("leave")
                        )
                        for i in range(n)
                    )
                )

        t0 = time.monotonic()
        outcomes = asyncio.run(scenario())
        clients_s = _since(t0)
        recovery = settled([gw], [s1, s2], timeout=60)
        fresh = fresh_request(gw, stream=True)
        st = [sim_stats(s1), sim_stats(s2)]
        ids = executed(s1, s2)
        report(
            "1,000 clients disconnect mid-stream",
            clients=labels(outcomes),
            all_clients_done_s=clients_s,
            started=len(ids),
            aborted=sum(s["aborted_total"] for s in st),
            duplicates=len(duplicates(ids)),
            settle_s=round(recovery, 2),
            fresh=fresh.label,
        )
        assert labels(outcomes) == {"left": n}
        assert not duplicates(ids)
        assert sum(s["aborted_total"] for s in st) == len(ids) - 1  # all but the fresh request
        assert all(s["running"] == 0 for s in st)
        assert all(wk["inflight"] == 0 for wk in workers(gw).values())
        assert fresh.label == "200"


async def _until(check: Callable[[], bool]) -> None:
    """Poll ``check`` for up to 10 s."""
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not within the time")


def test_non_streaming_clients_that_leave_free_their_slots(tmp_path: Path) -> None:
    # 6 s to the first token: a slot held until the worker answers would stay busy ~5 s after
    # the clients leave, one freed when they leave well under 3 s, however loaded the machine
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=16, ttft_ms=6000)
    gw = gateway(gateway_config([("w", w, 1)]), tmp_path)
    with running(w), running(gw, ready_path="/ready"):

        async def leave() -> list[asyncio.Future[Outcome]]:
            async with async_client(3) as c:
                first = asyncio.ensure_future(call(c, gw.url, body("n0"), "leaver-0"))
                await _until(lambda: bool(executed(w)))  # it runs (6 s to its first token)
                queued = [asyncio.ensure_future(call(c, gw.url, body(f"n{i}"), f"leaver-{i}"))
                          for i in (1, 2)]  # fmt: skip
                await _until(lambda: queue_depth(gw) == 2)
                await asyncio.sleep(0.3)
                # All three hang up, the queued two a moment before the running one. (Hung up
                # "together", an HTTP client's closes of three connections are milliseconds
                # apart under load, and a client still connected when the slot frees is rightly
                # sent; a close that is in but not yet read is the gateway's to see:
                # tests/gateway/test_client_gone.py.)
                for task in queued:
                    task.cancel()
                await asyncio.gather(*queued, return_exceptions=True)
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                return [first, *queued]

        calls = asyncio.run(leave())
        assert all(t.cancelled() for t in calls)  # none was answered: all three hung up
        busy_s = settled([gw], [w], timeout=15)
        report(
            "non-streaming clients hang up (1 running, 2 queued)",
            slot_busy_after_clients_left_s=round(busy_s, 2),
            started=executed(w),
        )
        assert busy_s < 3.0  # held to the answer: ~5 s (see the sim's ttft_ms)
        started = executed(w)
        assert len(started) == 1  # the queued two never ran (the worker sees the gateway's ids)


# ---- 10x overload -------------------------------------------------------------------------------


def test_ten_times_overload_burst(tmp_path: Path) -> None:
    s1, s2 = (sim(model=MODEL, tmp=tmp_path, max_num_seqs=64, ttft_ms=100) for _ in range(2))
    capacity = 8
    cfg = gateway_config([("s1", s1, 4), ("s2", s2, 4)], queue={"max_queued": 8})
    gw = gateway(cfg, tmp_path)
    with running(s1, s2), running(gw, ready_path="/ready"):
        t0 = time.monotonic()
        outcomes = asyncio.run(_concurrent(gw.url, 10 * capacity, "burst"))
        burst_s = _since(t0)
        recovery = settled([gw], [s1, s2])
        fresh = fresh_request(gw)
        ids = executed(s1, s2)
        peaks = {"s1": sim_stats(s1)["peak_running"], "s2": sim_stats(s2)["peak_running"]}
        seen = labels(outcomes)
        report(
            "10x overload burst (80 clients, capacity 8, max_queued 8)",
            clients=seen,
            peak_running=peaks,
            burst_s=burst_s,
            duplicates=len(duplicates(ids)),
            settle_s=round(recovery, 2),
            fresh=fresh.label,
        )
        _assert_nothing_lost(outcomes, {"200", "429"})
        assert seen.get("429", 0) > 0 and seen.get("200", 0) >= capacity + 8
        assert peaks["s1"] <= 4 and peaks["s2"] <= 4
        assert not duplicates(ids) and len(ids) == seen["200"] + 1
        assert fresh.label == "200"
