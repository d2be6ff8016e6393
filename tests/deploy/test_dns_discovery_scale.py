"""One DNS name answering 4,000 addresses (issue 35), through a real DNS server (dnsmasq), a
real `gpupool serve` under `ulimit -n 1024` and 4,000 addresses that accept connections and
never answer: the gateway keeps what its descriptors allow (the gateway's own share reserved),
says how many it left out (log line and `gpupool_discovery_dropped`), probes a bounded number
at once, and keeps answering `/health`, `/admin/workers`, `/metrics` and client requests
(served by the one real worker among the addresses)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpupool.gateway.ui.feed import MAX_WORKER_ROWS
from tests.deploy.dns import Dnsmasq, dnsmasq_binary
from tests.gateway.ui.pool import first_snapshot
from tests.support.procs import Proc, free_port, gateway, running, sim, wait_http
from tests.support.tarpit import address

pytestmark = [
    pytest.mark.skipif(dnsmasq_binary() is None, reason="dnsmasq is not installed"),
    pytest.mark.timeout(300),
]
N = 4000
NOFILE = 1024
TARPIT = Path(__file__).resolve().parents[1] / "support" / "tarpit.py"


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tarpit(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(TARPIT), str(port), str(N)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _limited(gw: Proc) -> Proc:
    gw.argv = ["prlimit", f"--nofile={NOFILE}:{NOFILE}", *gw.argv]
    return gw


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_four_thousand_addresses_under_ulimit_1024(
    dns: Dnsmasq, tarpit: int, tmp_path: Path
) -> None:
    port = tarpit
    worker = sim(port, model="m", tmp=tmp_path, host="127.0.0.2", itl_ms=1, output_tokens=4)
    worker.url = f"http://127.0.0.2:{port}"
    dns.set_a("big.gpupool.test", ["127.0.0.2", *(address(i) for i in range(N))])
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": "m"}],
        "workers": [{"name": "pool", "model": "m", "discover": {
            "dns": "big.gpupool.test", "port": port, "every_s": 1, "timeout_s": 10,
            "nameservers": [dns.nameserver]}}],
        "routing": {"retries": 0, "health_interval_s": 0.5, "health_timeout_s": 5,
                    "prefix_affinity": False},
    }  # fmt: skip
    gw = _limited(gateway(cfg, tmp_path))
    with running(worker), running(gw, timeout=120):
        wait_http(gw.url + "/ready", timeout=120)  # the real worker is found and probed
        for _ in range(20):  # while thousands of probes wait on hung hosts
            assert httpx.get(gw.url + "/health", timeout=10).status_code == 200
            r = httpx.post(gw.url + "/v1/completions", timeout=30,
                           json={"model": "m", "prompt": "hi", "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.headers["x-gpupool-worker"] == f"pool@127.0.0.2:{port}"
            assert _open_fds(gw.pid) < NOFILE // 2
        kept = (NOFILE - 256) // 4  # discovery.workers_for_descriptors(1024)
        listed = httpx.get(gw.url + "/admin/workers", timeout=30).json()
        assert len(listed["data"]) == listed["total"] == kept and not listed["has_more"]
        page = httpx.get(gw.url + "/admin/workers?offset=150&limit=20", timeout=30).json()
        assert [w["name"] for w in page["data"]] == [w["name"] for w in listed["data"][150:170]]
        assert page["has_more"] and page["total"] == kept
        assert httpx.get(gw.url + "/admin/workers?limit=0").status_code == 400
        snap = first_snapshot(gw.url)  # the pool page's feed: bounded cards, the rest counted
        assert len(snap["workers"]) == MAX_WORKER_ROWS and snap["workers_total"] == kept
        assert sum(snap["workers_hidden"].values()) == kept - MAX_WORKER_ROWS
        metrics = httpx.get(gw.url + "/metrics", timeout=30).text
        assert f'gpupool_discovery_dropped{{entry="pool"}} {float(N + 1 - kept)}' in metrics
        series = sum(1 for line in metrics.splitlines() if "worker=" in line)
        assert series < 20 * kept
    log = gw.log_path.read_text()
    assert log.count(f"{N + 1 - kept} of {N + 1} addresses left out (the descriptor limit") == 1
