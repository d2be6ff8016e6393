"""Where the added time goes at one connection: system calls, loop iterations and py-spy samples.

    .venv/bin/python bench/breakdown.py [--only gpupool,aiohttp-naive,vllm-router] [--seconds 5]
                                        [--baseline REV] [--json out.json]

Same layout as ``bench/wrkbench.py`` (nginx answering from memory and ``wrk`` on CPU0, each
gateway alone on CPU1). For every target, one connection of ``wrk``:

1. plain, for the p50 (the figure the others are read against);
2. under ``strace -c -f``: system calls per request, by call. ``epoll_wait``/``epoll_pwait``
   calls per request are the event-loop iterations per request (libuv's ``uv_run`` and tokio
   call it once per turn). strace slows the target, so only counts are read from this run;
3. under ``perf record -e cpu-clock``: the share of its CPU by binary (interpreter, kernel,
   uvloop, llhttp, libc, or a Rust router's own code);
4. under ``py-spy record --nonblocking`` (Python targets): the samples of the gateway's thread
   by function (self time) and by the gpupool frame that asked for the work. Samples whose
   innermost frame is the event loop's ``run`` line are C code below Python (uvloop, system
   calls) or time spent runnable; the Python shares are read among the others.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import wrkbench
from rig import RIG_CPU, ROOT, nice, oncpu_ns, pin_self, raise_nofile
from targets import Target, baseline_tree, build

PYSPY = ROOT / ".venv" / "bin" / "py-spy"
# Innermost frames that mean "inside the event loop's C code": asyncio.run, aiohttp's run_app
_LOOP_RUN = frozenset({"Runner.run", "run_app", "run_until_complete", "run_forever"})
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def syscalls(t: Target, wrk: str, script: Path, seconds: float, tmp: Path) -> dict[str, Any]:
    """System calls per request of the target's whole process tree, from ``strace -c -f``."""
    out = tmp / f"strace-{t.name}.txt"
    assert t.pid is not None
    pid = _server_pid(t.pid)
    tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(pid)],
                              stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)
    res = wrkbench.run_wrk(wrk, t.port, script, 1, seconds)
    tracer.send_signal(2)
    tracer.wait(30)
    calls: dict[str, int] = {}
    for line in out.read_text().splitlines():
        m = _ROW.match(line)
        if m and m[2] != "total":
            calls[m[2]] = int(m[1])
    n = max(1, res["requests"])
    ranked = sorted(calls.items(), key=lambda kv: -kv[1])
    per = {k: round(v / n, 2) for k, v in ranked if v / n >= 0.01}
    loops = sum(v for k, v in calls.items() if k.startswith("epoll_"))
    return {
        "requests": n,
        "per_request": per,
        "total_per_request": round(sum(calls.values()) / n, 2),
        "loop_iterations_per_request": round(loops / n, 2),
    }


def _server_pid(pid: int) -> int:
    """The process that serves (``taskset`` execs it, so the pid is already the server's)."""
    return pid


def pyspy(t: Target, wrk: str, script: Path, seconds: float, tmp: Path) -> dict[str, Any]:
    """py-spy samples during one connection of wrk: by function (self) and by gpupool frame."""
    assert t.pid is not None
    raw = tmp / f"pyspy-{t.name}.txt"
    argv = [str(PYSPY), "record", "--nonblocking", "-r", "997", "-d", str(int(seconds) + 1),
            "-f", "raw", "-o", str(raw), "-p", str(t.pid)]  # fmt: skip
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    res = wrkbench.run_wrk(wrk, t.port, script, 1, seconds)
    spy.wait(60)
    return summarise(raw.read_text() if raw.exists() else "", res["requests"], seconds)


def perf_split(t: Target, wrk: str, script: Path, seconds: float, tmp: Path) -> dict[str, float]:
    """Share of the target's CPU samples by binary (``perf record -e cpu-clock``): the Python
    interpreter, the kernel, uvloop, llhttp, libc... (empty when ``perf`` is missing)."""
    if shutil.which("perf") is None or t.pid is None:
        return {}
    data = tmp / f"perf-{t.name}.data"
    argv = ["perf", "record", "-e", "cpu-clock", "-F", "2999", "-o", str(data), "-p", str(t.pid)]
    rec = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrkbench.run_wrk(wrk, t.port, script, 1, seconds)
    rec.send_signal(2)
    rec.wait(60)
    report = ["perf", "report", "-i", str(data), "--sort", "dso", "--stdio", "-g", "none"]
    text = subprocess.run(report, capture_output=True, text=True).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*([\d.]+)%\s+(\S+)", line)
        if m and float(m[1]) >= 0.5:
            out[m[2]] = float(m[1])
    return out


def summarise(text: str, requests: int, seconds: float) -> dict[str, Any]:
    """Python samples (the loop's own ``run`` line left out) by file and by function, as
    percentages of the Python samples."""
    by_file: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = python = 0
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        frame = stack.split(";")[-1]
        if frame.split(" (")[0] in _LOOP_RUN:
            continue  # C below Python (uvloop, system calls) or waiting to run
        python += count
        short = _short(frame)
        leaf[short] += count
        by_file[short.rpartition(" (")[2].split(":")[0].rstrip(")")] += count

    def pct(c: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(k, round(100 * v / max(1, python), 1)) for k, v in c.most_common(n)]

    return {
        "samples": total,
        "python_samples": python,
        "requests": requests,
        "python_by_file_percent": pct(by_file, 20),
        "python_self_percent": pct(leaf, 30),
    }


def _short(frame: str) -> str:
    func, _, rest = frame.partition(" (")
    path = rest.rstrip(")")
    for cut in ("site-packages/", "python3.11/", "/perf/", "gpupool-"):
        if cut in path:
            path = path.split(cut, 1)[1]
    return f"{func} ({path})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="gpupool,aiohttp-naive,vllm-router")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--baseline", default=None, help="A git revision to run as gpupool-base.")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    pin_self(RIG_CPU)
    raise_nofile()
    nice(-10)
    found = wrkbench.tools()
    if isinstance(found, str):
        raise SystemExit(found)
    wrk, nginx = found
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-breakdown-"))
    nginx_proc, port = wrkbench.start_nginx(nginx, tmp)
    targets: list[Target] = []
    out: dict[str, Any] = {}
    try:
        base = baseline_tree(args.baseline, tmp) if args.baseline else None
        targets = build(["direct", *args.only.split(",")], port, tmp, tmp, None, base)
        for t in targets:
            t.start()
        for t in targets:
            t.wait(240)
        everyone = [t.pid for t in targets if t.pid is not None]
        for t in targets:
            script = wrkbench.lua_script(tmp, t.headers)
            with wrkbench.alone(t.pid, everyone):
                wrkbench.run_wrk(wrk, t.port, script, 1, 1)
                cpu0 = oncpu_ns(t.pid) if t.pid is not None else 0
                plain = wrkbench.run_wrk(wrk, t.port, script, 1, args.seconds)
                # on-CPU time at c=1 is what one request costs end to end, and robust to a
                # busy machine in a way the latency is not
                cpu = oncpu_ns(t.pid) - cpu0 if t.pid is not None else 0
                row: dict[str, Any] = {
                    "p50_us": plain["p50_us"],
                    "p99_us": plain["p99_us"],
                    "rps": round(plain["rps"]),
                    "cpu_us_per_request": round(cpu / 1000 / plain["requests"], 1),
                }
                if t.pid is not None:
                    row["strace"] = syscalls(t, wrk, script, args.seconds, tmp)
                    row["perf_dso_percent"] = perf_split(t, wrk, script, args.seconds, tmp)
                    if t.name.startswith(("gpupool", "aiohttp")):
                        row["pyspy"] = pyspy(t, wrk, script, args.seconds, tmp)
            out[t.name] = row
            print(json.dumps({t.name: row}, indent=1), flush=True)
    finally:
        for t in targets:
            t.stop()
        nginx_proc.stop()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
