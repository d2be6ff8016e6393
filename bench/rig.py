"""The rig: pinned processes, readiness, and what /proc says about CPU and memory.

CPU layout on the 2-core box: the gateway under test alone on CPU1 (``GATEWAY_CPU``); the upstream,
the load generator and everything else of the rig on CPU0 (``RIG_CPU``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
VENVS = BENCH / ".venvs"
# gpupool's interpreter; the GPU lane (no venv there) sets GPUPOOL_BENCH_PYTHON=python3
PY = Path(os.environ.get("GPUPOOL_BENCH_PYTHON") or ROOT / ".venv" / "bin" / "python")
# A folder whose bin/ already holds the peers' commands (the GPU lane's offline install): used
# instead of a venv made with pip, which needs the network
PEERS_PREFIX = os.environ.get("GPUPOOL_BENCH_PEERS_PREFIX", "")
RIG_CPU, GATEWAY_CPU = 0, 1
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin_self(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})


def nice(n: int) -> int:
    """Run at niceness ``n`` (children inherit it) where allowed; returns the niceness."""
    if n:
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, n)
    return os.getpriority(os.PRIO_PROCESS, 0)


def raise_nofile(want: int = 65536) -> int:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(want, hard) if hard != resource.RLIM_INFINITY else want
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def http_ok(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return bool(200 <= r.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Proc:
    """A child process pinned to one CPU, in its own session so it can be stopped whole."""

    name: str
    argv: list[str]
    cpu: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["taskset", "-c", str(self.cpu), *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(self, url: str, timeout: float, headers: dict[str, str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            if http_ok(url, headers=headers):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: {url} not ready after {timeout:.0f}s\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)  # it may be paused (see `alone`)
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def alone(pid: int | None, everyone: list[int]) -> Iterator[None]:
    """Pause (SIGSTOP) every other gateway's process group so that ``pid`` has CPU1 to itself:
    an idle gateway's background work (health checks, schedulers) must not land in another's
    figures. ``pid`` None: the upstream is measured directly, every gateway is paused."""
    others = [p for p in everyone if p != pid]
    for p in others:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in others:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGCONT)


# ---- /proc ----------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [
                    int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                ]
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def rss_bytes(pid: int, skip: tuple[str, ...] = ("taskset",)) -> int:
    """Resident memory of a process tree (the gateway and any workers it forked)."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            comm = Path(f"/proc/{p}/comm").read_text().strip()
            if comm in skip:
                continue
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
    return total


def cpu_seconds(pid: int, whole_tree: bool = True) -> float:
    """User + system CPU time of a process tree (living processes only), or of one process."""
    total = 0
    for p in tree(pid) if whole_tree else [pid]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def oncpu_ns(pid: int) -> int:
    """Nanoseconds on CPU of every thread of ``pid`` (``/proc/<pid>/task/*/schedstat``): exact,
    where ``cpu_seconds`` counts in clock ticks."""
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    return total


def cpu_times() -> dict[int, tuple[float, float]]:
    """Per CPU: (busy, total) jiffies since boot."""
    out: dict[int, tuple[float, float]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            v = [float(x) for x in vals]
            idle = v[3] + v[4]
            out[int(name[3:])] = (sum(v[:8]) - idle, sum(v[:8]))
    return out


class CpuMeter:
    """Busy fraction of each CPU, and CPU seconds of chosen process trees, over a window."""

    def __init__(self, pids: dict[str, int], alone: frozenset[str] = frozenset({"client"})) -> None:
        """``alone``: names whose own process is counted without its children."""
        self.pids, self.alone = pids, alone
        self.t0 = time.monotonic()
        self.c0 = cpu_times()
        self.p0 = {k: self._cpu(k) for k in pids}

    def _cpu(self, name: str) -> float:
        return cpu_seconds(self.pids[name], whole_tree=name not in self.alone)

    def read(self) -> dict[str, float]:
        c1 = cpu_times()
        out = {}
        for cpu, (busy, total) in c1.items():
            b0, t0 = self.c0.get(cpu, (0.0, 0.0))
            out[f"cpu{cpu}_busy"] = (busy - b0) / max(1.0, total - t0)
        wall = max(1e-6, time.monotonic() - self.t0)
        for k in self.pids:
            out[f"{k}_cpu"] = (self._cpu(k) - self.p0[k]) / wall  # cores used
        return out


# ---- virtual environments -------------------------------------------------------------------


def ensure_venv(name: str, spec: str, binary: str, log: Path) -> Path:
    """``bench/.venvs/<name>`` with ``spec`` installed; returns the path of ``binary``.

    A venv missing its interpreter or the binary (an interrupted install) is made again.
    With ``GPUPOOL_BENCH_PEERS_PREFIX`` set, ``binary`` is taken from its ``bin/`` instead."""
    if PEERS_PREFIX:
        found = Path(PEERS_PREFIX) / "bin" / binary
        if not found.exists():
            raise RuntimeError(f"{binary} not in {found.parent} (GPUPOOL_BENCH_PEERS_PREFIX)")
        return found
    venv = VENVS / name
    exe = venv / "bin" / binary
    if exe.exists() and (venv / "bin" / "python").exists():
        return exe
    if venv.exists():
        shutil.rmtree(venv)
    VENVS.mkdir(parents=True, exist_ok=True)
    print(f"  installing {spec} into {venv.relative_to(ROOT)} (once) ...", flush=True)
    with open(log, "ab") as out:
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True, stdout=out, stderr=out)
        pip = [str(venv / "bin" / "pip"), "install", "-q", spec]
        subprocess.run(pip, check=True, stdout=out, stderr=out, timeout=1200)
    if not exe.exists():
        raise RuntimeError(f"{spec} installed but {exe} is missing")
    return exe


def pip_version(exe: Path, dist: str) -> str:
    py = exe.parent / "python"
    if not py.exists():  # installed into a prefix, not a venv: the running interpreter's path
        py = Path(shutil.which("python3") or "python3")
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or "?"
