"""A tenant's share of a model's queue, through real ``gpupool serve`` processes and both backends.

One worker slot, ``max_queued: 4``, ``max_queued_per_tenant: 2``: a batch tenant fills its two
places, its next request gets 429 with ``Retry-After``, and another tenant still queues and is
served.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.procs import gateway, redis_server, running, sim

BATCH, CHAT = "sk-batch-1", "sk-chat-1"


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _post(url: str, key: str, hold_ms: int = 0) -> httpx.Response:
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    headers = {"authorization": f"Bearer {key}", "x-sim-hold-ms": str(hold_ms)}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def _hold_the_slot(url: str) -> socket.socket:
    """A batch request that holds the worker's one slot until its client hangs up (the
    gateway then cancels it and gives the slot to the next in line): no hold's length to
    guess on a loaded machine."""
    host, port = urlsplit(url).hostname or "", urlsplit(url).port or 80
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"authorization: Bearer {BATCH}\r\nx-sim-hold-ms: 300000\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
    conn = socket.create_connection((host, port), timeout=30)
    conn.sendall(head.encode() + body)
    return conn


def _queued(url: str) -> int:
    snap = httpx.get(url + "/admin/queue", headers={"authorization": "Bearer sk-admin-1"}).json()
    return int(snap.get("models", {}).get("m", {}).get("depth", 0))


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_one_tenant_cannot_fill_the_queue_over_http(tmp_path: Path, backend: str) -> None:
    redis = redis_server(tmp_path)
    worker = sim(model="m", tmp=tmp_path, max_num_seqs=1, ttft_ms=800)
    queue: dict[str, Any] = {"max_queued": 4, "max_queued_per_tenant": 2, "max_wait_s": 30}
    if backend == "redis":
        queue |= {"backend": "redis", "redis_url": redis.url}
    cfg = {
        "models": [{"name": "m"}],
        "workers": [{"name": "w", "model": "m", "url": worker.url, "max_inflight": 1}],
        "queue": queue,
        "auth": {
            "enabled": True,
            "admin_key_sha256": _h("sk-admin-1"),
            "keys": [
                {"name": "batch", "sha256": _h(BATCH)},
                {"name": "chat", "sha256": _h(CHAT)},
            ],
        },
    }
    gw = gateway(cfg, tmp_path)
    with running(redis, worker, gw), ThreadPoolExecutor(4) as pool:
        # takes the slot, and keeps it while two more queue and a third is refused, until its
        # client hangs up: a hold of 0.8 s (the time to first token alone), then 4 s, then 12 s
        # ran out on a loaded machine before the second had queued
        first = _hold_the_slot(gw.url)
        try:
            waiting = []
            for depth in (1, 2):
                waiting.append(pool.submit(_post, gw.url, BATCH))
                deadline = time.monotonic() + 60
                while _queued(gw.url) < depth:
                    assert time.monotonic() < deadline, f"the queue never held {depth}"
                    time.sleep(0.02)
            refused = _post(gw.url, BATCH)
            assert refused.status_code == 429, refused.text
            assert "share of the queue" in refused.json()["error"]["message"]
            assert int(refused.headers["retry-after"]) >= 1
            chat = pool.submit(_post, gw.url, CHAT)  # another tenant still gets a place
            deadline = time.monotonic() + 60
            while _queued(gw.url) < 3:
                assert time.monotonic() < deadline, "the other tenant never queued"
                time.sleep(0.02)
        finally:
            first.close()  # the slot goes to the first in line
        codes = [f.result().status_code for f in (*waiting, chat)]
        assert codes == [200, 200, 200]
