"""Beyond one gateway: two replicas on one Redis and one `url:` swap group would both put its
workers to sleep and wake them, each beside the other's choice (issue 37: 36 ledger violations
in 30 s). One replica claims the group in Redis (gateway/swap_lease.py); a second stands by
(serving nothing, saying whose the group is) and takes the group over once the first's claim
lapses: the first killed, frozen past the claim's TTL, or stopped. A Redis restart (empty) does
not hand the group over: the holder takes its claim back first. The two simulated workers share
one simulated GPU's ledger, which records any wake beside an awake member and any request that
reached a sleeping one: it stays empty through every hand-over."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.gateway.swap.tools import ledger_of, wait_states
from tests.support.procs import Proc, gateway, redis_server, running, sim, wait_redis

TTL_S = 3.0  # the claim's: 3 x lease_ttl_s


def _config(a: str, b: str, redis_url: str, prefix: str) -> dict[str, Any]:
    return {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": [
            {"name": "a", "model": "coder", "url": a, "swap_group": "shared"},
            {"name": "b", "model": "chat", "url": b, "swap_group": "shared"},
        ],
        "routing": {"health_interval_s": 0.3, "metrics_interval_s": 3600},
        "swap": {"min_awake_s": 0.2},
        "queue": {
            "backend": "redis",
            "redis_url": redis_url,
            "redis_prefix": prefix,
            "lease_ttl_s": TTL_S / 3,
        },
    }


def _ask(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.completions.create(model=model, prompt="hi", max_tokens=4).choices[0].text


def _dir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


@contextmanager
def _sims(tmp: Path) -> Iterator[tuple[Proc, Proc]]:
    """Two url: workers on one simulated GPU (0.85 of it each: never both awake): ``a``
    (coder) awake, ``b`` (chat) asleep."""
    ledger = str(tmp / "gpu0-ledger.json")
    opts = {"enable_sleep_mode": True, "itl_ms": 5, "sleep_ledger": ledger,
            "gpu_memory_utilization": 0.85}  # fmt: skip
    a, b = sim(model="coder", tmp=tmp, **opts), sim(model="chat", tmp=tmp, **opts)
    with running(b):
        httpx.post(b.url + "/sleep?level=1", timeout=10).raise_for_status()  # a fits beside it
        with running(a):
            yield a, b


def _ready(gw: Proc) -> bool:
    try:
        # 10 s, not 2: a loaded machine's slow answer is no "not ready" (and a ready check fails)
        return httpx.get(gw.url + "/ready", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _until_ready(gw: Proc, timeout: float = 60) -> float:
    """Seconds until ``gw`` (started already) answers /ready."""
    t0 = time.monotonic()
    while not _ready(gw):
        assert gw.proc is not None and gw.proc.poll() is None, gw.logs()
        assert time.monotonic() - t0 < timeout, gw.logs()
        time.sleep(0.1)
    return time.monotonic() - t0


def _standing_by(gw: Proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while "this one stands by" not in gw.logs():
        assert time.monotonic() < deadline, gw.logs()
        time.sleep(0.1)
    assert not _ready(gw) and gw.proc is not None and gw.proc.poll() is None


def _serves_both(gw: Proc) -> None:
    """Both models answer through ``gw`` (a switch each way), under a little load."""
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda m: _ask(gw.url, m), ["chat", "coder"] * 4))


def _clean(tmp: Path, gw: Proc) -> None:
    """No two members awake, no request to a sleeping one (ledger); nothing held by ``gw``."""
    assert ledger_of(tmp)["violations"] == []
    held = httpx.get(gw.url + "/admin/held", timeout=10).json()
    assert set(held["inflight"].values()) <= {0} and set(held["slots"].values()) <= {0}
    assert set(held["queued"].values()) <= {0}


def test_a_second_replica_stands_by_and_takes_over_once_the_first_is_stopped(
    tmp_path: Path,
) -> None:
    redis = redis_server(_dir(tmp_path, "redis"))
    with running(redis), _sims(tmp_path) as (a, b):
        cfg = _config(a.url, b.url, redis.url, "stop")
        first, second = gateway(cfg, _dir(tmp_path, "one")), gateway(cfg, _dir(tmp_path, "two"))
        with running(first, ready_path="/ready", timeout=90):
            wait_states(first, {"a": "ready", "b": "asleep"})
            second.start()
            try:
                _standing_by(second)
                _serves_both(first)  # the first switches under load; the second stays out
                assert not _ready(second)
                assert "swap group `shared` is controlled by another gateway replica" in (
                    second.logs()
                )
                _clean(tmp_path, first)
            except BaseException:
                second.stop()
                raise
        # the first stopped (SIGTERM): its claim released, the second takes the group
        with ExitStack() as stack:
            stack.callback(second.stop)
            _until_ready(second)
            _serves_both(second)
            _clean(tmp_path, second)


def test_a_killed_holder_is_replaced_once_its_claim_lapses(tmp_path: Path) -> None:
    redis = redis_server(_dir(tmp_path, "redis"))
    with running(redis), _sims(tmp_path) as (a, b):
        cfg = _config(a.url, b.url, redis.url, "kill")
        first, second = gateway(cfg, _dir(tmp_path, "one")), gateway(cfg, _dir(tmp_path, "two"))
        with running(first, ready_path="/ready", timeout=90), ExitStack() as stack:
            stack.callback(second.stop)
            wait_states(first, {"a": "ready", "b": "asleep"})
            second.start()
            _standing_by(second)
            _serves_both(first)
            first.kill(signal.SIGKILL)  # no release: the claim lapses a TTL after its renewal
            took = _until_ready(second)
            print(f"killed holder: the standby ready {took:.1f} s later (TTL {TTL_S:g} s)")
            assert "the other replica's claim lapsed" in second.logs()
            _serves_both(second)
            _clean(tmp_path, second)


def test_a_frozen_holder_fences_itself_and_the_standby_takes_over(tmp_path: Path) -> None:
    """The first frozen (SIGSTOP) past its claim's TTL: the second takes the group; thawed,
    the first acts on nothing (its claim is stale), then learns the claim is another's and
    stops its group. Both replicas then get requests; only the second switches."""
    redis = redis_server(_dir(tmp_path, "redis"))
    with running(redis), _sims(tmp_path) as (a, b):
        cfg = _config(a.url, b.url, redis.url, "freeze")
        first, second = gateway(cfg, _dir(tmp_path, "one")), gateway(cfg, _dir(tmp_path, "two"))
        with running(first, ready_path="/ready", timeout=90), ExitStack() as stack:
            stack.callback(second.stop)
            wait_states(first, {"a": "ready", "b": "asleep"})
            second.start()
            _standing_by(second)
            first.kill(signal.SIGSTOP)
            try:
                _until_ready(second)
            finally:
                first.kill(signal.SIGCONT)
            deadline = time.monotonic() + 30
            while "stops controlling it" not in first.logs():
                assert time.monotonic() < deadline, first.logs()
                time.sleep(0.1)
            # the first routes nothing more to the group's workers: the second controls them
            seen = wait_states(first, {"a": "failed", "b": "failed"}, timeout=10)
            assert "is controlled by replica" in (seen["a"]["last_error"] or "")
            # an admin switch there would sleep the second's holder or wake beside it
            r = httpx.post(first.url + "/admin/workers/b/wake", timeout=10)
            assert r.status_code == 503 and "not controlled by this" in r.text, r.text
            _serves_both(second)
            _clean(tmp_path, second)


def test_a_redis_restart_leaves_the_group_with_its_holder(tmp_path: Path) -> None:
    """Redis killed and started again, empty: the first takes its claim back within a renew
    period, before the standby's confirmation, so the group is not handed over; the first
    switched nothing meanwhile (fenced once the claim could have lapsed) and switches again
    after."""
    redis = redis_server(_dir(tmp_path, "redis"))
    with running(redis), _sims(tmp_path) as (a, b):
        cfg = _config(a.url, b.url, redis.url, "restart")
        first, second = gateway(cfg, _dir(tmp_path, "one")), gateway(cfg, _dir(tmp_path, "two"))
        with running(first, ready_path="/ready", timeout=90), ExitStack() as stack:
            stack.callback(second.stop)
            wait_states(first, {"a": "ready", "b": "asleep"})
            second.start()
            _standing_by(second)
            redis.stop()
            assert _ask(first.url, "coder")  # the awake model serves through the outage
            deadline = time.monotonic() + 30
            while "no switch until it is" not in first.logs():
                assert time.monotonic() < deadline, first.logs()
                time.sleep(0.1)
            redis.start()
            wait_redis(redis.url)
            deadline = time.monotonic() + 30
            while "switching resumes" not in first.logs():
                assert time.monotonic() < deadline, first.logs()
                time.sleep(0.1)
            time.sleep(TTL_S)  # (the standby's chance to take it, were the holder gone)
            assert not _ready(second) and "claim lapsed" not in second.logs()
            _serves_both(first)
            assert not _ready(second)
            _clean(tmp_path, first)


def test_a_standby_stops_on_sigterm(tmp_path: Path) -> None:
    redis = redis_server(_dir(tmp_path, "redis"))
    with running(redis), _sims(tmp_path) as (a, b):
        cfg = _config(a.url, b.url, redis.url, "sigterm")
        first, second = gateway(cfg, _dir(tmp_path, "one")), gateway(cfg, _dir(tmp_path, "two"))
        with running(first, ready_path="/ready", timeout=90), ExitStack() as stack:
            stack.callback(second.stop)
            second.start()
            _standing_by(second)
            assert second.proc is not None
            second.proc.terminate()
            second.proc.wait(timeout=15)  # (within a renew period or so; not timed here)
            assert "stopped while standing by" in second.logs()
            assert _ready(first) and ledger_of(tmp_path)["violations"] == []
