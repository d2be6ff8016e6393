"""Python function calls per request on gpupool's hot path: a count, not a time.

    .venv/bin/python bench/callcount.py [--requests 2000] [--top 40] [--baseline REV]

Same upstream as ``bench/wrkbench.py`` (nginx answering from memory) and the same request (its
small chat body, at one connection), but the gateway runs under ``cProfile`` and ``wrk`` sends
a fixed number of requests. Prints the calls per request (every Python function and C builtin
the profiler sees), and the functions that make them. Unlike a time, the count does not move
with the machine's load: it is the figure to watch while cutting the per-request work, beside
``wrkbench.py``'s times.
"""

from __future__ import annotations

import argparse
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import wrkbench
from rig import PY, ROOT, Proc, free_port
from targets import MODELS, baseline_tree

# wrk's script: stop after a fixed number of requests (each thread counts its own).
STOP_AFTER = """
local n = 0
response = function()
  n = n + 1
  if n >= {count} then wrk.thread:stop() end
end
"""


def gateway_config(tmp: Path, port: int, upstream: int) -> Path:
    import yaml

    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False,
                   "state_dir": str(tmp / "state")},
        "models": [{"name": m} for m in MODELS],
        "workers": [{"name": f"up-{m}", "model": m, "url": f"http://127.0.0.1:{upstream}",
                     "max_inflight": 100_000} for m in MODELS],
        "queue": {"backend": "memory", "max_queued": 100_000},
    }  # fmt: skip
    path = tmp / "gpupool.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def profile(
    source: Path, upstream: int, tmp: Path, wrk: str, warm: int, count: int
) -> tuple[Path, int]:
    """Run the gateway from ``source`` under cProfile, ``warm`` requests unprofiled first;
    the profile and the number of requests it saw."""
    port = free_port()
    cfg = gateway_config(tmp, port, upstream)
    out = tmp / f"profile-{source.name}.pstats"
    driver = tmp / "driver.py"
    driver.write_text(
        "import cProfile, signal, sys, threading\n"
        f"sys.path.insert(0, {str(source)!r})\n"
        "from gpupool.cli.main import main\n"
        "prof = cProfile.Profile()\n"
        "signal.signal(signal.SIGUSR1, lambda *_: prof.enable())\n"
        "def dump(*_):\n"
        f"    prof.disable(); prof.dump_stats({str(out)!r})\n"
        "signal.signal(signal.SIGUSR2, dump)\n"
        f"sys.argv = ['gpupool', 'serve', '--config', {str(cfg)!r}]\n"
        "main()\n"
    )
    proc = Proc("gpupool", [str(PY), str(driver)], 1, tmp / "gpupool.log").start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", 60)
        plain = wrkbench.lua_script(tmp, {})
        script = tmp / "wrk-count.lua"
        seen = 0
        for n, profiled in ((warm, False), (count, True)):
            script.write_text(plain.read_text() + STOP_AFTER.format(count=n))
            if profiled:
                proc.proc.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
                time.sleep(0.2)
            # wrk runs for its whole duration even once its thread stopped: keep it short, and
            # count what it sent.
            seen = wrkbench.run_wrk(wrk, port, script, 1, max(5.0, n / 100))["requests"]
        proc.proc.send_signal(signal.SIGUSR2)  # type: ignore[union-attr]
        for _ in range(100):
            if out.exists():
                break
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        proc.stop()
    return out, seen


def report(path: Path, count: int, top: int, label: str) -> float:
    stats = pstats.Stats(str(path))
    rows = stats.stats  # type: ignore[attr-defined]
    total = sum(nc for (_, nc, _, _, _) in rows.values())
    per = total / count
    print(f"\n{label}: {per:.1f} calls per request ({total} calls, {count} requests)")
    print("calls/req  own µs/req (under the profiler)  function")
    for column in (1, 2):
        if column == 2:
            print("\nby own time under the profiler:")
        for (file, line, name), row in sorted(rows.items(), key=lambda kv: -kv[1][column])[:top]:
            calls, own = row[1] / count, row[2] / count * 1e6
            print(f"{calls:7.2f}  {own:6.2f}  {name}  ({_where(file)}:{line})")
    return per


def _where(file: str) -> str:
    where = file.replace(str(ROOT) + "/", "")
    for marker in ("site-packages/", "lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warm", type=int, default=500)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--baseline", metavar="REV", help="Also count another revision's gateway.")
    p.add_argument("--keep", type=Path, help="Copy the profile (pstats) here.")
    args = p.parse_args()
    found = wrkbench.tools()
    if isinstance(found, str):
        sys.exit(found)
    wrk, nginx = found
    with tempfile.TemporaryDirectory(prefix="gpupool-callcount-") as t:
        tmp = Path(t)
        upstream, port = wrkbench.start_nginx(nginx, tmp)
        try:
            sources = [("gpupool", ROOT)]
            if args.baseline:
                sources.append((f"gpupool@{args.baseline}", baseline_tree(args.baseline, tmp)))
            figures = {}
            for label, source in sources:
                prof, seen = profile(source, port, tmp, wrk, args.warm, args.requests)
                if args.keep is not None and label == "gpupool":
                    shutil.copy(prof, args.keep)
                figures[label] = report(prof, seen, args.top, label)
        finally:
            upstream.stop()
            subprocess.run(["true"])
    if len(figures) == 2:
        (a, x), (b, y) = figures.items()
        print(f"\n{a} / {b}: {x / y:.2f}x the calls per request")


if __name__ == "__main__":
    main()
