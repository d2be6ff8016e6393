"""Machine instructions per request on gpupool's hot path, counted by valgrind's callgrind.

    .venv/bin/python bench/instructions.py [--requests 1000] [--baseline REV]

The same upstream and request as ``bench/wrkbench.py`` (nginx answering from memory, its small
chat body, one connection), with the gateway run under ``valgrind --tool=callgrind``: after
300 requests of warm-up the counters are zeroed, then ``--requests`` more are sent and the
counters dumped. Instructions do not move with the machine's load or speed (times on this
shared machine move by 2x between rounds), so this is the steadiest A/B figure for a change to
the hot path; ``--baseline REV`` counts another revision's gateway beside this checkout's, both
at once (one core each). Slow: valgrind runs the gateway some 50x slower (about 5 minutes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import wrkbench
from callcount import STOP_AFTER, gateway_config
from rig import PY, ROOT, free_port, http_ok
from targets import baseline_tree


def count(source: Path, upstream: int, tmp: Path, wrk: str, warm: int, n: int) -> float:
    """Instructions per request of the gateway from ``source`` (``n`` requests counted)."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cfg = gateway_config(tmp, port, upstream)
    out = tmp / "callgrind.out"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
            str(PY), "-m", "gpupool", "serve", "--config", str(cfg)]  # fmt: skip
    with open(tmp / "gateway.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=source,
                                env={**os.environ, "PYTHONPATH": str(source)})  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not http_ok(f"http://127.0.0.1:{port}/health", 5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway under valgrind did not start: see {tmp}")
            time.sleep(1)
        plain = wrkbench.lua_script(tmp, {})
        script = tmp / "wrk-count.lua"
        seen = 0
        for requests, zero in ((warm, True), (n, False)):
            script.write_text(plain.read_text() + STOP_AFTER.format(count=requests))
            # wrk runs for its whole duration even once its thread stopped (about 20 ms a
            # request under valgrind): count what it sent.
            seen = wrkbench.run_wrk(wrk, port, script, 1, max(20.0, requests / 20))["requests"]
            if zero:
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True)
        time.sleep(2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    dumps = sorted(tmp.glob("callgrind.out.*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise RuntimeError(f"callgrind wrote no dump: see {tmp}")
    found = re.search(r"^(?:summary|totals): (\d+)", dumps[0].read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no totals in {dumps[0]}")
    return int(found[1]) / seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warm", type=int, default=300)
    p.add_argument("--baseline", metavar="REV", help="Also count another revision's gateway.")
    args = p.parse_args()
    found = wrkbench.tools()
    if isinstance(found, str):
        sys.exit(found)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("valgrind (with callgrind_control) is not installed")
    wrk, nginx = found
    with tempfile.TemporaryDirectory(prefix="gpupool-instructions-") as t:
        tmp = Path(t)
        upstream, port = wrkbench.start_nginx(nginx, tmp)
        try:
            sources = {"gpupool": ROOT}
            if args.baseline:
                sources[f"gpupool@{args.baseline}"] = baseline_tree(args.baseline, tmp)
            with concurrent.futures.ThreadPoolExecutor(len(sources)) as pool:
                run = (port, wrk, args.warm, args.requests)
                jobs = {
                    label: pool.submit(count, src, run[0], tmp / label, *run[1:])
                    for label, src in sources.items()
                }
                figures = {label: job.result() for label, job in jobs.items()}
        finally:
            upstream.stop()
    for label, per in figures.items():
        print(f"{label}: {per:,.0f} instructions per request ({args.requests} requests)")
    if len(figures) == 2:
        (a, x), (b, y) = figures.items()
        print(f"{a} / {b}: {x / y:.3f}x the instructions per request")


if __name__ == "__main__":
    main()
