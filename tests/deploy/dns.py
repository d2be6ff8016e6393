"""A real DNS server on loopback for discovery tests: dnsmasq from the distribution.

Records live in a hosts file (A records) that :meth:`Dnsmasq.set_a` rewrites and dnsmasq re-reads
on SIGHUP, and in a config file (SRV records) that needs a restart (:meth:`Dnsmasq.set_srv`):
a restart is a window in which lookups fail, which the SRV test uses on purpose. Names under
``gpupool.test`` are answered locally and never forwarded (NXDOMAIN when unknown).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.procs import free_port

DOMAIN = "gpupool.test"


def dnsmasq_binary() -> str | None:
    return shutil.which("dnsmasq", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def free_udp_port() -> int:
    """A port free for both UDP and TCP (dnsmasq listens on both), picked like every test port."""
    while True:
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


class Dnsmasq:
    def __init__(self, tmp: Path, port: int | None = None) -> None:
        binary = dnsmasq_binary()
        assert binary is not None
        self.binary, self.tmp = binary, tmp
        self.port = port or free_udp_port()
        self.hosts, self.conf, self.log = tmp / "dns-hosts", tmp / "dns-srv.conf", tmp / "dns.log"
        self.hosts.write_text("")
        self.conf.write_text("")
        self._a: dict[str, list[str]] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Dnsmasq:
        argv = [
            self.binary,
            "--keep-in-foreground",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts}",
            f"--conf-file={self.conf}",
            f"--local=/{DOMAIN}/",
            "--user=root",
            "--pid-file=",
            f"--log-facility={self.log}",
            "--log-queries",
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_listening()
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            if "started" in (self.log.read_text() if self.log.exists() else ""):
                return
            time.sleep(0.05)
        raise TimeoutError(f"dnsmasq did not start: {self.log.read_text()}")

    def set_a(self, name: str, ips: list[str]) -> None:
        """``name``'s A records are now ``ips`` (dnsmasq re-reads on SIGHUP, at once)."""
        self._a[name] = ips
        lines = [f"{ip} {n}\n" for n, addrs in self._a.items() for ip in addrs]
        tmp = self.hosts.with_suffix(".new")
        tmp.write_text("".join(lines))
        tmp.replace(self.hosts)
        if self.proc is not None:
            before = self._reads()
            self.proc.send_signal(signal.SIGHUP)
            # 30 s: the re-read is at once on a quiet machine; 10 s ran out at load 14-20 with
            # 4,000 addresses while the gateway's resolver kept it busy (test_dns_discovery)
            deadline = time.monotonic() + 30
            while self._reads() == before:
                assert time.monotonic() < deadline, f"dnsmasq did not re-read {self.hosts}"
                time.sleep(0.02)

    def _reads(self) -> int:
        return self.log.read_text().count(f"read {self.hosts} - ")

    def set_srv(self, name: str, targets: list[tuple[str, int]]) -> None:
        """``name``'s SRV records (target host, port); takes a restart: lookups fail meanwhile."""
        self.conf.write_text("".join(f"srv-host={name},{h},{p}\n" for h, p in targets))
        if self.proc is not None:
            self.stop()
            self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None
