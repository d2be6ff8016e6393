"""Real processes for tests: simulated workers, gateways and Redis servers on loopback ports."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


# Ports for the tests' servers come from below the kernel's ephemeral range (32768-60999 here),
# so no outgoing connection takes one between the pick and the server's bind, and every test
# process on the machine (xdist workers, other checkouts' runs) records its picks in one file
# under a lock, so two of them never hand out the same port within PORT_HOLD_S.
PORTS = range(20000, 32000)
PORT_HOLD_S = 300.0
PORT_FILE = Path(tempfile.gettempdir()) / "gpupool-test-ports"


def free_port() -> int:
    """A loopback TCP port that nothing listens on and no test process picked lately."""
    with open(PORT_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        now = time.time()
        recent = {}
        for line in f.read().split("\n"):
            port, _, at = line.partition(" ")
            with contextlib.suppress(ValueError):
                if now - float(at) < PORT_HOLD_S:
                    recent[int(port)] = float(at)
        port = _bindable(set(recent))
        recent[port] = now
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {at}\n" for p, at in recent.items()))
    return port


def _bindable(taken: set[int]) -> int:
    for _ in range(1000):
        port = random.choice(PORTS)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PORTS} after 1000 tries")


def wait_http(url: str, timeout: float = 30.0, status: int = 200) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == status:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not answering {status}: {last}")


def wait_redis(url: str, timeout: float = 10.0) -> None:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"redis at {url} not answering")


class Proc:
    def __init__(self, argv: list[str], url: str, log: Path, env: dict[str, str] | None = None):
        self.argv, self.url, self.log_path = argv, url, log
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]


def sim(port: int | None = None, *, model: str = "m", max_model_len: int = 4096,
        tmp: Path | None = None, **opts: Any) -> Proc:  # fmt: skip
    port = port or free_port()
    argv = [sys.executable, "-m", "gpupool.workers.sim", "--port", str(port),
            "--served-model-name", model, "--max-model-len", str(max_model_len)]  # fmt: skip
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not False and v is not None:
            argv += [flag, str(v)]
    logdir = tmp or Path(tempfile.mkdtemp())
    return Proc(argv, f"http://127.0.0.1:{port}", logdir / f"sim-{port}.log")


def gateway(cfg: dict[str, Any], tmp: Path, port: int | None = None) -> Proc:
    port = port or free_port()
    cfg = {**cfg, "server": {**cfg.get("server", {}), "port": port}}
    cfg["server"].setdefault("state_dir", str(tmp / "state"))
    path = tmp / f"gpupool-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "gpupool", "serve", "--config", str(path)]
    return Proc(argv, f"http://127.0.0.1:{port}", tmp / f"gateway-{port}.log")


@contextlib.contextmanager
def running(*procs: Proc, ready_path: str = "/health", timeout: float = 30) -> Iterator[None]:
    try:
        for p in procs:
            p.start()
        for p in procs:
            try:
                if p.url.startswith("redis://"):
                    wait_redis(p.url, timeout)
                else:
                    wait_http(p.url + ready_path, timeout=timeout)
            except TimeoutError:
                raise TimeoutError(f"{p.argv}\n{p.logs()}") from None
        yield
    finally:
        for p in procs:
            p.stop()


def redis_server(tmp: Path, port: int | None = None) -> Proc:
    port = port or free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(tmp)]  # fmt: skip
    return Proc(argv, f"redis://127.0.0.1:{port}/0", tmp / f"redis-{port}.log")
