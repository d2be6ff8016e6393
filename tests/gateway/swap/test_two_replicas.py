"""Beyond one gateway: two replicas on one Redis and one `url:` swap group would both put its
workers to sleep and wake them, each beside the other's choice (issue 37: 36 ledger violations
in 30 s). One replica claims the group in Redis (gateway/swap_lease.py); a second refuses to
serve, naming the group and the holder; once the first stops, its claim is released and a new
replica takes the group. The sims' own records prove nobody woke beside anybody."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.conftest import RedisServer
from tests.gateway.swap.tools import wait_states
from tests.support.procs import Proc, gateway, running, sim


def _config(a: str, b: str, redis: RedisServer, prefix: str) -> dict[str, Any]:
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
            "redis_url": redis.url,
            "redis_prefix": prefix,
            "lease_ttl_s": 1.0,
        },
    }


def _ask(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.completions.create(model=model, prompt="hi", max_tokens=4).choices[0].text


def _dir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def _violations(*workers: Proc) -> list[str]:
    return [v for w in workers for v in httpx.get(w.url + "/sim/sleep").json()["violations"]]


def test_a_second_replica_refuses_a_group_the_first_controls(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    a = sim(model="coder", tmp=tmp_path, enable_sleep_mode=True, itl_ms=5)
    b = sim(model="chat", tmp=tmp_path, enable_sleep_mode=True, itl_ms=5)
    cfg = _config(a.url, b.url, redis_server, f"two-{tmp_path.name}")
    first, second = gateway(cfg, _dir(tmp_path, "one")), gateway(cfg, _dir(tmp_path, "two"))
    with running(a, b):
        with running(first, ready_path="/ready", timeout=90):
            wait_states(first, {"a": "ready", "b": "asleep"})
            second.start()
            with ThreadPoolExecutor(4) as pool:  # the first serves under load meanwhile
                answers = list(pool.map(lambda m: _ask(first.url, m), ["chat", "coder"] * 6))
                assert all(answers)
                deadline = time.monotonic() + 60
                while second.proc is not None and second.proc.poll() is None:
                    assert time.monotonic() < deadline, "the second replica kept serving"
                    time.sleep(0.1)
            assert second.proc is not None and second.proc.returncode != 0
            log = second.logs()
            assert "swap group `shared` is controlled by another gateway replica" in log, log
            assert _violations(a, b) == []
        # the first stopped: its claim was released, and a new replica takes the group
        third = gateway(cfg, _dir(tmp_path, "three"))
        with running(third, ready_path="/ready", timeout=90):
            assert _ask(third.url, "chat") and _ask(third.url, "coder")
            assert _violations(a, b) == []
