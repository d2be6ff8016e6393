"""Without `tenancy.salt_secret` or an admin key, a tenant's `cache_salt` (so its warm prefix
cache) stays the same across a reload and a restart, and two replicas on one Redis give it the
same one; two tenants still differ. Through real `gpupool serve` processes and a recording
worker, reloaded by SIGHUP (no admin key: no admin API)."""

from __future__ import annotations

import hashlib
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from gpupool.gateway.tenancy.secret import FILE
from tests.conftest import RedisServer
from tests.gateway.tenancy.fake_worker import FakeWorker
from tests.support.procs import Proc, gateway, running

MODEL = "m"
A1, A2, B, C = "sk-a1-salt", "sk-a2-salt", "sk-b-salt", "sk-c-salt"


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cfg(worker: str, *keys: tuple[str, str, str], **extra: Any) -> dict[str, Any]:
    auth = {"enabled": True,
            "keys": [{"name": n, "sha256": _h(k), "tenant": t} for n, k, t in keys]}  # fmt: skip
    return {"models": [{"name": MODEL}], "auth": auth, "routing": {"health_interval_s": 0.5},
            "workers": [{"name": "w1", "model": MODEL, "url": worker}], **extra}  # fmt: skip


KEYS = (("a1", A1, "team-a"), ("a2", A2, "team-a"), ("b", B, "t1"))


def _until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def salt(gw: str, worker: FakeWorker, key: str) -> str:
    """The `cache_salt` the worker got for a completion sent with ``key`` (waits for ready)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    headers = {"authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 30
    while (r := httpx.post(gw + "/v1/completions", json=body, headers=headers,
                           timeout=30)).status_code != 200:  # fmt: skip
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    got = worker.seen[-1].body["cache_salt"]
    assert isinstance(got, str) and len(got) == 43
    return got


def _reload(g: Proc, n: int) -> None:
    """SIGHUP, then wait for the ``n``-th logged reload."""
    g.kill(signal.SIGHUP)
    _until(lambda: g.log_path.read_text().count("reload (SIGHUP): ") >= n, "no reload logged")


def test_a_tenants_salt_survives_reloads_and_restarts(tmp_path: Path) -> None:
    w = FakeWorker(MODEL)
    with w.running():
        g = gateway(_cfg(w.url, *KEYS), tmp_path)
        config = Path(g.argv[g.argv.index("--config") + 1])
        with running(g):
            a, b = salt(g.url, w, A1), salt(g.url, w, B)
            assert a != b and salt(g.url, w, A2) == a
            _reload(g, 1)  # the same file
            assert salt(g.url, w, A1) == a and salt(g.url, w, B) == b
            cfg = yaml.safe_load(config.read_text())
            cfg["auth"]["keys"].append({"name": "c", "sha256": _h(C), "tenant": "t2"})
            config.write_text(yaml.safe_dump(cfg))
            _reload(g, 2)  # a new tenant: its own salt, the others' unchanged
            assert salt(g.url, w, C) not in (a, b)
            assert salt(g.url, w, A1) == a and salt(g.url, w, B) == b
        path = tmp_path / "state" / FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with running(g):  # restarted on the same state_dir
            assert salt(g.url, w, A1) == a and salt(g.url, w, B) == b


def test_replicas_on_one_redis_give_a_tenant_the_same_salt(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    w = FakeWorker(MODEL)
    queue = {"backend": "redis", "redis_url": own_redis.url}
    (tmp_path / "two").mkdir()
    with w.running():
        one = gateway(_cfg(w.url, *KEYS, queue=queue), tmp_path)
        two = gateway(_cfg(w.url, *KEYS, queue=queue), tmp_path / "two")  # its own state_dir
        with running(one, two):
            a, b = salt(one.url, w, A1), salt(one.url, w, B)
            assert a != b
            assert salt(two.url, w, A1) == a and salt(two.url, w, A2) == a
            assert salt(two.url, w, B) == b
            _reload(two, 1)
            assert salt(two.url, w, A1) == a
