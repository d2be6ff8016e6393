"""Workers found by DNS, against a real DNS server (dnsmasq on loopback) whose records change
while clients (the openai SDK, streaming) keep the gateway busy.

Simulated workers listen on distinct loopback addresses (127.0.0.11, .12, ...) with one port,
as containers or pods behind one name do; SRV records give ports. ``routing.retries`` is 0, so
a request the gateway sent to a worker that cannot serve it reaches the client as an error:
none may fail. What each worker received is read from its own ``/sim/stats``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.dns import DOMAIN, Dnsmasq, dnsmasq_binary
from tests.deploy.load import Load, wait_until
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, running, sim, wait_http

pytestmark = pytest.mark.skipif(
    dnsmasq_binary() is None,
    reason="dnsmasq is not installed (`make ops-deps` installs Debian's dnsmasq-base)",
)

MODEL = "m"
EVERY_S = 0.3
HEALTH_S = 0.3


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def _config(discover: dict[str, Any]) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL}],
        "workers": [{"name": "pool", "model": MODEL, "discover": discover}],
        "routing": {"retries": 0, "health_interval_s": HEALTH_S, "prefix_affinity": False},
    }


def _worker(host: str, port: int, tmp: Path, **opts: Any) -> Proc:
    proc = sim(
        port, model=MODEL, tmp=tmp, host=host, itl_ms=20, output_tokens=12, max_num_seqs=16, **opts
    )
    proc.url = f"http://{host}:{port}"
    proc.log_path = tmp / f"sim-{host}-{port}.log"
    return proc


def _states(gw: str) -> dict[str, str]:
    data = httpx.get(gw + "/admin/workers", timeout=10).json()["data"]
    return {w["name"]: w["state"] for w in data}


def _requests(worker: Proc) -> int:
    return int(httpx.get(worker.url + "/sim/stats", timeout=10).json()["requests_total"])


def test_a_records_scale_down_and_up_under_load(dns: Dnsmasq, tmp_path: Path) -> None:
    """Two workers behind one name; one leaves DNS mid-load (its running requests finish, it
    gets no new ones, it is removed); a third appears while not ready (no request reaches it
    until its probe passes), then joins and serves. No client sees an error."""
    name, port = f"pool.{DOMAIN}", free_port()
    a, b, c = (_worker(f"127.0.0.{i}", port, tmp_path) for i in (11, 12, 13))
    dns.set_a(name, ["127.0.0.11", "127.0.0.12"])
    discover = {"dns": name, "port": port, "every_s": EVERY_S, "nameservers": [dns.nameserver]}
    gw = gateway(_config(discover), tmp_path)
    wa, wb, wc = (f"pool@127.0.0.{i}:{port}" for i in (11, 12, 13))
    with running(a, b, c), running(gw, ready_path="/ready"):
        wait_until(lambda: _states(gw.url) == {wa: "ready", wb: "ready"}, "both workers ready")
        httpx.post(c.url + "/sim/control", json={"health_fail": True}, timeout=10)
        with Load(gw.url, MODEL) as load:
            load.wait_for(12)
            wait_until(lambda: _requests(b) > 0, "traffic on b")
            dns.set_a(name, ["127.0.0.11"])  # b leaves
            wait_until(lambda: wb not in _states(gw.url), "b removed")
            served_by_b = _requests(b)
            load.wait_for(12)
            assert _requests(b) == served_by_b, "b got requests after it left DNS"

            dns.set_a(name, ["127.0.0.11", "127.0.0.13"])  # c appears, not ready yet
            wait_until(lambda: _states(gw.url).get(wc) == "starting", "c seen, starting")
            load.wait_for(12)
            assert _requests(c) == 0, "c got requests before its probe passed"
            assert _states(gw.url)[wc] == "starting"
            httpx.post(c.url + "/sim/control", json={"health_fail": False}, timeout=10)
            wait_until(lambda: _states(gw.url).get(wc) == "ready", "c ready")
            load.wait_for(12)
            wait_until(lambda: _requests(c) > 0, "traffic on c")
        assert not load.errors, load.errors[:5]
        assert load.ok >= 48
        assert_nothing_held(gw.url)
        assert _states(gw.url) == {wa: "ready", wc: "ready"}


def test_srv_records_and_a_failing_server_keep_the_last_good_set(
    dns: Dnsmasq, tmp_path: Path
) -> None:
    """SRV records carry the ports. While the DNS server is down every lookup fails: the workers
    stay, the failures are counted; once it answers again with one target, the other leaves."""
    srv = f"_vllm._tcp.{DOMAIN}"
    p1, p2 = free_port(), free_port()
    w1, w2 = _worker("127.0.0.1", p1, tmp_path), _worker("127.0.0.1", p2, tmp_path)
    dns.set_a(f"w.{DOMAIN}", ["127.0.0.1"])
    dns.set_srv(srv, [(f"w.{DOMAIN}", p1), (f"w.{DOMAIN}", p2)])
    discover = {
        "dns": srv,
        "record": "srv",
        "every_s": EVERY_S,
        "timeout_s": 0.5,
        "nameservers": [dns.nameserver],
    }
    gw = gateway(_config(discover), tmp_path)
    n1, n2 = f"pool@127.0.0.1:{p1}", f"pool@127.0.0.1:{p2}"
    with running(w1, w2), running(gw, ready_path="/ready"):
        wait_until(lambda: _states(gw.url) == {n1: "ready", n2: "ready"}, "both SRV targets ready")
        with Load(gw.url, MODEL) as load:
            load.wait_for(10)
            dns.stop()
            wait_until(lambda: _failures(gw.url) >= 2, "failed lookups counted")
            load.wait_for(10)
            assert _states(gw.url) == {n1: "ready", n2: "ready"}  # the last good set stays
            dns.conf.write_text(f"srv-host={srv},w.{DOMAIN},{p1}\n")
            dns.start()
            wait_until(lambda: n2 not in _states(gw.url), "the second target removed")
            served = _requests(w2)
            load.wait_for(10)
            assert _requests(w2) == served
        assert not load.errors, load.errors[:5]
        assert_nothing_held(gw.url)
        log = gw.logs()
        assert "lookup failed, keeping 2 workers" in log


def _failures(gw: str) -> float:
    text = httpx.get(gw + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("gpupool_discovery_failures_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_missing_name_is_no_workers_and_the_gateway_still_starts(
    dns: Dnsmasq, tmp_path: Path
) -> None:
    """NXDOMAIN is an answer (a service scaled to zero): no workers, not a failure."""
    discover = {
        "dns": f"none.{DOMAIN}",
        "port": 9,
        "every_s": EVERY_S,
        "nameservers": [dns.nameserver],
    }
    gw = gateway(_config(discover), tmp_path)
    with running(gw):
        wait_http(gw.url + "/health")
        time.sleep(EVERY_S * 3)
        assert _states(gw.url) == {}
        assert _failures(gw.url) == 0


def test_reload_starts_and_stops_discovery(dns: Dnsmasq, tmp_path: Path) -> None:
    """A gateway started with one url: worker gets a discover: entry by POST /admin/reload (its
    workers join), then loses it again (they drain and go); the url: worker is untouched."""
    name, port = f"pool.{DOMAIN}", free_port()
    fixed = _worker("127.0.0.1", free_port(), tmp_path)
    found = _worker("127.0.0.21", port, tmp_path)
    dns.set_a(name, ["127.0.0.21"])
    static = {
        "models": [{"name": MODEL}],
        "workers": [{"name": "fixed", "model": MODEL, "url": fixed.url}],
        "routing": {"health_interval_s": HEALTH_S},
    }
    gw = gateway(static, tmp_path)
    config = tmp_path / f"gpupool-{gw.url.rsplit(':', 1)[1]}.yaml"
    entry = {
        "name": "pool",
        "model": MODEL,
        "discover": {
            "dns": name,
            "port": port,
            "every_s": EVERY_S,
            "nameservers": [dns.nameserver],
        },
    }
    with running(fixed, found), running(gw, ready_path="/ready"):
        data = yaml.safe_load(config.read_text())
        data["workers"].append(entry)
        config.write_text(yaml.safe_dump(data))
        r = httpx.post(gw.url + "/admin/reload", timeout=30)
        assert r.status_code == 200, r.text
        assert "pool" in r.json()["workers"]["added"]
        want = {"fixed": "ready", f"pool@127.0.0.21:{port}": "ready"}
        wait_until(lambda: _states(gw.url) == want, "the discovered worker ready")
        data["workers"] = data["workers"][:1]
        config.write_text(yaml.safe_dump(data))
        r = httpx.post(gw.url + "/admin/reload", timeout=30)
        assert r.status_code == 200 and "pool" in r.json()["workers"]["removed"], r.text
        wait_until(lambda: _states(gw.url) == {"fixed": "ready"}, "the discovered worker gone")
