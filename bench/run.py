"""`make bench`: gpupool against its peers and against the upstream reached directly.

    .venv/bin/python bench/run.py [--quick] [--only gpupool,vllm-router] [--skip memory,rate]
                                  [--skip-real-vllm] [--profile] [--nice -10]

One run, on this 2-core box: a precomputed-bytes upstream (bench/upstream.py) and the load
generator on CPU0; each gateway alone on CPU1 (one process, one core); all gateways up at once so
that every phase interleaves them round by round. Peers are installed into bench/.venvs/ when
missing. Writes bench/results/{results.md,results.json,chart.png} (and profile.md with --profile).

Phases: latency (c=1 non-streaming), stream (paced SSE), memory (idle streams), rate (highest
rate at p99 < 10 ms), admission (bench/bench_admission.py), wrk (a second client: wrk against an
nginx upstream, bench/wrkbench.py), real-vllm (bench/real_vllm.py).

``--baseline REV`` adds ``gpupool-base``: gpupool as of commit REV (``git archive``), measured
interleaved with this checkout by every phase, for before/after figures from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import phases
import report
import uvloop
from rig import (
    BENCH,
    GATEWAY_CPU,
    PY,
    RIG_CPU,
    Proc,
    alone,
    cpu_times,
    free_port,
    pin_self,
    raise_nofile,
)
from targets import ALL, PEERS, Target, baseline_tree, build

RESULTS = BENCH / "results"
PHASES = ("latency", "stream", "memory", "rate", "admission", "wrk", "real-vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="Fewer rounds and shorter steps.")
    p.add_argument(
        "--only",
        default=",".join(["gpupool", "gpupool-redis", *PEERS]),
        help=f"Comma-separated targets besides `direct` (known: {', '.join(ALL)}).",
    )
    p.add_argument(
        "--skip", default="", help=f"Comma-separated phases to skip ({', '.join(PHASES)})."
    )
    p.add_argument("--skip-real-vllm", action="store_true", help="Same as --skip real-vllm.")
    p.add_argument(
        "--profile",
        action="store_true",
        help="Also profile gpupool under load with py-spy (.venv/bin/py-spy).",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="Niceness of the rig and gateways (negative needs root; 0 to leave it).",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="A git revision of gpupool to measure beside this checkout (as gpupool-base).",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="Where results are written.")
    p.add_argument(
        "--render",
        action="store_true",
        help="Only write results.md and chart.png again from --out/results.json.",
    )
    args = p.parse_args(argv)
    args.targets = ["direct", *[n for n in args.only.split(",") if n and n != "direct"]]
    if args.baseline and "gpupool-base" not in args.targets:
        args.targets.append("gpupool-base")
    args.skipped = {s for s in args.skip.split(",") if s}
    if args.skip_real_vllm:
        args.skipped.add("real-vllm")
    unknown = args.skipped - set(PHASES)
    if unknown:
        p.error(f"unknown phase(s) {', '.join(sorted(unknown))} (known: {', '.join(PHASES)})")
    return args


def _nice(n: int) -> int:
    if n:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, n)
        except PermissionError:
            print(f"  (could not set niceness {n}: not root; running at 0)", flush=True)
    return os.getpriority(os.PRIO_PROCESS, 0)


def _meta(args: argparse.Namespace, niceness: int) -> dict[str, Any]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host_cpu": cpu,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "quick": args.quick,
        "niceness": niceness,
        "pinning": {"gateway": GATEWAY_CPU, "upstream_and_client": RIG_CPU},
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
    }


def _start_redis(tmp: Path) -> tuple[Proc, str]:
    port = free_port()
    argv = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp),
    ]
    proc = Proc("redis", argv, RIG_CPU, tmp / "redis.log").start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        if r.stdout.strip() == "PONG":
            return proc, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.1)
    raise RuntimeError(f"redis did not start:\n{proc.tail()}")


def _admission(redis_url: str, quick: bool) -> dict[str, Any]:
    """bench/bench_admission.py on the gateway core, Redis on the rig core."""
    argv = [
        "taskset",
        "-c",
        str(GATEWAY_CPU),
        str(PY),
        str(BENCH / "bench_admission.py"),
        "--redis-url",
        redis_url,
    ]
    if quick:
        argv += ["--iterations", "2000", "--seconds", "1"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    out: dict[str, Any] = {"raw": r.stdout}
    pattern = r"^(memory|redis)\s+([\d.]+) µs\s+([\d.]+) µs\s+(\d+)"
    for m in re.finditer(pattern, r.stdout, re.M):
        out[m[1]] = {"p50_us": float(m[2]), "p99_us": float(m[3]), "grants_per_s": int(m[4])}
    if r.returncode:
        out["error"] = r.stderr[-2000:]
    return out


def _real_vllm(tmp: Path, quick: bool, niceness: int) -> dict[str, Any]:
    out = tmp / "real_vllm.json"
    argv = [str(PY), str(BENCH / "real_vllm.py"), "--json", str(out)] + (
        ["--quick"] if quick else []
    )
    r = subprocess.run(argv, timeout=1200)
    if r.returncode or not out.exists():
        return {"error": f"bench/real_vllm.py exited {r.returncode}"}
    return dict(json.loads(out.read_text()))


def _phase(name: str, args: argparse.Namespace) -> bool:
    if name in args.skipped:
        return False
    print(f"\n== {name}", flush=True)
    return True


def _guarded(name: str, res: dict[str, Any], fn: Callable[[], Any]) -> None:
    """Run one phase; a failure is recorded in the results and the run goes on."""
    try:
        res[name] = fn()
    except Exception as e:
        print(f"  phase {name} failed: {type(e).__name__}: {e}", flush=True)
        res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"


def _memory(targets: list[Target], plan: phases.Plan) -> dict[str, Any]:
    held = [t for t in targets if t.pid is not None and t.name != "gpupool-redis"]
    everyone = [t.pid for t in targets if t.pid is not None]
    return {t.name: uvloop.run(phases.idle_memory(t, plan, everyone)) for t in held}


def _measure(args: argparse.Namespace, plan: phases.Plan, targets: list[Target],
             rig: dict[str, int], redis_url: str | None, res: dict[str, Any]) -> None:  # fmt: skip
    """Every phase over the running targets, in an order that leaves the heaviest for last."""
    streamers = [t for t in targets if t.name != "gpupool-redis"]
    if _phase("latency", args):
        _guarded("latency", res, lambda: uvloop.run(phases.latency(targets, plan)))
        report.print_latency(res.get("latency", {}))
        for name, lat in res.get("latency", {}).items():
            if "kv_routed" in lat:
                print(f"  {name} requests by routing mode: {lat['kv_routed']}")
    if _phase("stream", args):
        _guarded("stream", res, lambda: uvloop.run(phases.streaming(streamers, plan)))
        report.print_stream(res.get("stream", {}))
    if _phase("memory", args):
        _guarded("memory", res, lambda: _memory(targets, plan))
    if _phase("rate", args):
        _guarded("rate", res, lambda: uvloop.run(phases.max_rate(targets, plan, rig)))
        report.print_rate(res.get("rate", {}))
    if _phase("admission", args) and redis_url:
        _guarded("admission", res, lambda: _admission(redis_url, args.quick))
        print(res.get("admission", {}).get("raw", ""), flush=True)
    gp = next((t for t in targets if t.name == "gpupool"), None)
    if args.profile and gp is not None and gp.pid is not None:
        import profile_gateway

        print("\n== profile (py-spy)", flush=True)
        best = res.get("rate", {}).get("gpupool", {}).get("max_rps_10ms") or 500
        pid, port = gp.pid, gp.port
        with alone(pid, [t.pid for t in targets if t.pid is not None]):
            _guarded(
                "profile", res, lambda: profile_gateway.run(pid, port, args.out, best, args.quick)
            )


def _run_targets(
    args: argparse.Namespace, plan: phases.Plan, tmp: Path, res: dict[str, Any]
) -> None:
    port = free_port()
    argv = [str(PY), str(BENCH / "upstream.py"), "--port", str(port), "--pace-ms", "20",
            "--idle-s", "20"]  # fmt: skip
    upstream = Proc("upstream", argv, RIG_CPU, tmp / "upstream.log")
    procs: list[Proc] = [upstream.start()]
    targets: list[Target] = []
    try:
        upstream.wait_http(f"http://127.0.0.1:{port}/health", 30)
        redis_url = None
        if "gpupool-redis" in args.targets or "admission" not in args.skipped:
            redis, redis_url = _start_redis(tmp)
            procs.append(redis)
        targets = build(args.targets, port, tmp, tmp, redis_url, args.base_tree)
        names = ", ".join(f"{t.name} {t.version}".strip() for t in targets)
        print(f"starting: {names}", flush=True)
        for t in targets:
            t.start()
        for t in targets:
            t.wait(240)
        res["targets"] = {t.name: {"version": t.version, "note": t.note} for t in targets}
        rig = {"client": os.getpid(), "upstream": upstream.pid}
        _measure(args, plan, targets, rig, redis_url, res)
    finally:
        for t in targets:
            t.stop()
        for p in reversed(procs):
            p.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        report.write(json.loads((args.out / "results.json").read_text()), args.out)
        print(f"wrote {args.out}/results.md and chart.png", flush=True)
        return
    began = time.monotonic()
    pin_self(RIG_CPU)
    raise_nofile()
    niceness = _nice(args.nice)
    plan = phases.Plan.quick() if args.quick else phases.Plan()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-"))
    res: dict[str, Any] = {"meta": _meta(args, niceness)}
    args.base_tree = baseline_tree(args.baseline, tmp) if args.baseline else None
    res["meta"]["baseline"] = args.baseline
    busy0 = sum(b for b, _ in cpu_times().values())
    print(f"gpupool bench: logs in {tmp}; results in {args.out}", flush=True)
    res["meta"]["logs"] = str(tmp)
    try:
        _run_targets(args, plan, tmp, res)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
        print(f"the gateway phases stopped: {type(e).__name__}: {e}", flush=True)
        res.setdefault("errors", {})["targets"] = f"{type(e).__name__}: {str(e)[:2000]}"
    res["meta"]["bench_s"] = round(time.monotonic() - began, 1)
    busy1 = sum(b for b, _ in cpu_times().values())
    wall = max(1.0, time.monotonic() - began)
    res["meta"]["machine_busy_cores"] = round((busy1 - busy0) / os.sysconf("SC_CLK_TCK") / wall, 2)
    if _phase("wrk", args):
        import wrkbench

        rounds, seconds = (2, 2.0) if args.quick else (3, 5.0)
        res["wrk"] = wrkbench.phase(args.targets, tmp, rounds, seconds, args.base_tree)
        wrkbench.print_summary(res["wrk"])
    if _phase("real-vllm", args):
        res["real_vllm"] = _real_vllm(tmp, args.quick, niceness)
    res["meta"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    res["meta"]["total_s"] = round(time.monotonic() - began, 1)
    report.write(res, args.out)
    print(
        f"\nwrote {args.out}/results.md, results.json, chart.png "
        f"({res['meta']['total_s']:.0f} s in all)",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
