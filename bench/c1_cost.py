"""What one request at a time costs each gateway: c=1 latency and the gateway's CPU per request.

    .venv/bin/python bench/c1_cost.py [--only gpupool,gpupool-precise,vllm-router] [--n 3000]
                                      [--cprofile DIR]

The overhead bench's c=1 phase (``bench/run.py``: the zero-latency upstream, non-streaming
"Say something." chats on one keep-alive connection, each gateway alone on its core), with the
gateway's CPU time per request read from ``/proc/PID/task/*/schedstat`` around the run: the
figure the added latency is mostly made of, steadier than a p50 on a shared machine.
``--cprofile DIR`` runs the gpupool targets under cProfile (enabled for the measured requests
only) and writes ``DIR/NAME.prof`` (``python -m pstats``); their figures then include
cProfile's own cost.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import loadgen
import phases
import uvloop
from rig import BENCH, PY, RIG_CPU, Proc, alone, free_port, oncpu_ns, pin_self
from targets import Target, build

_CPROFILED = """
import cProfile, os, signal, sys
prof = cProfile.Profile()
def dump(*_):
    prof.disable(); prof.dump_stats(os.environ["GPUPOOL_CPROFILE"]); os._exit(0)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, dump)
sys.argv = ["gpupool", *sys.argv[1:]]
from gpupool.cli.main import main
main()
"""


def _profiled(t: Target, out: Path, tmp: Path) -> None:
    """Run ``t`` (a gpupool target) under cProfile, written to ``out/NAME.prof``."""
    assert t.proc is not None
    script = tmp / "cprofiled.py"
    script.write_text(_CPROFILED)
    t.proc.argv = [str(PY), str(script), *t.proc.argv[3:]]  # after `python -m gpupool`
    t.proc.env = {**t.proc.env, "GPUPOOL_CPROFILE": str(out / f"{t.name}.prof")}


def _measure(t: Target, n: int, pids: list[int], profiled: bool) -> str:
    req = loadgen.request_bytes(t.port, phases.PATH, phases.body("fast", False), t.headers)
    with alone(t.pid, pids):
        uvloop.run(loadgen.sequential(t.port, req, 300))  # warm
        if profiled and t.pid is not None:
            os.kill(t.pid, signal.SIGUSR1)
            time.sleep(0.2)
        cpu0 = oncpu_ns(t.pid) if t.pid is not None else 0
        lat = uvloop.run(loadgen.sequential(t.port, req, n))
        cpu = (oncpu_ns(t.pid) - cpu0) / n / 1e3 if t.pid is not None else 0.0
        if profiled and t.pid is not None:
            os.kill(t.pid, signal.SIGUSR2)
            time.sleep(2)
    ms = sorted(x * 1e3 for x in lat)
    modes = f"; routed {t.kv_routed()}" if t.precise else ""
    return (f"{t.name:20} p50 {statistics.median(ms):.3f} ms, mean {statistics.mean(ms):.3f} ms,"
            f" gateway CPU {cpu:.1f} us a request{modes}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="gpupool,gpupool-precise,vllm-router")
    ap.add_argument("--n", type=int, default=3000, help="Measured requests per target.")
    ap.add_argument("--cprofile", type=Path, default=None, help="Profile gpupool targets here.")
    args = ap.parse_args()
    pin_self(RIG_CPU)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-c1-"))
    port = free_port()
    argv = [str(PY), str(BENCH / "upstream.py"), "--port", str(port), "--pace-ms", "20",
            "--idle-s", "20"]  # fmt: skip
    upstream = Proc("upstream", argv, RIG_CPU, tmp / "upstream.log").start()
    targets: list[Target] = []
    try:
        upstream.wait_http(f"http://127.0.0.1:{port}/health", 30)
        targets = build(["direct", *args.only.split(",")], port, tmp, tmp, None)
        profiled = {t.name for t in targets if args.cprofile and t.name.startswith("gpupool")}
        if args.cprofile:
            args.cprofile.mkdir(parents=True, exist_ok=True)
        for t in targets:
            if t.name in profiled:
                _profiled(t, args.cprofile, tmp)
            t.start()
        for t in targets:
            t.wait(240)
        pids = [t.pid for t in targets if t.pid is not None]
        for t in targets:
            print(_measure(t, args.n, pids, t.name in profiled), flush=True)
    finally:
        for t in targets:
            t.stop()
        upstream.stop()


if __name__ == "__main__":
    main()
