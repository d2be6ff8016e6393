"""A small pool for the page's tests: two simulated workers behind a real `gpupool serve`."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import Proc, gateway, running, sim

ADMIN, CLIENT = "sk-admin-ui", "sk-client-ui"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
MODEL, OTHER = "m", "other"


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Pool:
    gw: Proc
    w1: Proc
    w2: Proc

    @property
    def url(self) -> str:
        return self.gw.url


def config(w1: str, w2: str, *, auth: bool = True) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL}, {"name": OTHER}],
        "workers": [{"name": "w1", "model": MODEL, "url": w1, "max_inflight": 4},
                    {"name": "w2", "model": OTHER, "url": w2, "max_inflight": 4}],
        "auth": {"enabled": auth, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "client", "sha256": _h(CLIENT)}]},
        # not faster: a health check in flight when a drain lands makes the drained worker
        # ready again (workers/remote.py re-reads no state after its probe; reported)
        "routing": {"health_interval_s": 1.0, "fail_threshold": 1},
    }  # fmt: skip


@contextlib.contextmanager
def pool(tmp: Path, *, auth: bool = True) -> Iterator[Pool]:
    w1, w2 = sim(model=MODEL, tmp=tmp), sim(model=OTHER, tmp=tmp)
    gw = gateway(config(w1.url, w2.url, auth=auth), tmp)
    with running(w1, w2), running(gw):
        yield Pool(gw, w1, w2)


def first_snapshot(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The first ``event: pool`` of ``GET /admin/events`` (the stream is closed after it)."""
    with httpx.stream("GET", url + "/admin/events", headers=headers, timeout=10) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data: dict[str, Any] = json.loads(line[6:])
                return data
    raise AssertionError("the stream ended before its first event")
