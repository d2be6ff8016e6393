"""The second, independent client: ``wrk`` (C) against an nginx upstream answering from memory.

    .venv/bin/python bench/run.py --only gpupool,vllm-router,sglang-router --skip ...  # with others
    .venv/bin/python bench/wrkbench.py [--only gpupool,vllm-router] [--rounds 3] [--seconds 5]

Everything else in ``make bench`` uses this repository's own Python load generator and upstream;
this phase checks their figures with neither: ``wrk`` sends the requests, Debian's nginx answers
every one from memory (``return 200 '<body>'``, a config generated into a temp dir, run in the
foreground as an unprivileged user on a free port). Both are installed by
``scripts/install_ops_deps.sh bench``.

Layout: each gateway alone on CPU1 (the others paused), ``wrk`` and nginx on CPU0. Per round and
target: a 1-second warm-up, then one connection for ``seconds`` (``--latency``: p50/p99), then
32 connections for ``seconds`` (the sustained rate). Rounds interleave the targets, rotated;
the figures are the medians over rounds, and every round is kept in ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rig import BENCH, RIG_CPU, Proc, alone, free_port, nice, oncpu_ns, pin_self, raise_nofile
from targets import Target, baseline_tree, build
from upstream import Canned

WRK_TARGETS = ("gpupool", "gpupool-base", "aiohttp-naive", "python-floor", "python-floor-task",
               "vllm-router", "sglang-router")  # fmt: skip
BODY = b'{"model":"fast","messages":[{"role":"user","content":"Say something."}],"max_tokens":64}'
PATH = "/v1/chat/completions"
# wrk's ``done()`` hook prints the figures as JSON (microseconds), not rounded text.
LUA = """
local f = assert(io.open("{body}", "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
{headers}
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"p50_us\\":%d,\\"p90_us\\":%d," ..
    "\\"p99_us\\":%d,\\"max_us\\":%d,\\"mean_us\\":%.2f,\\"non2xx\\":%d,\\"errors\\":%d}}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.status,
    e.connect + e.read + e.write + e.timeout))
end
"""


def tools() -> tuple[str, str] | str:
    """``(wrk, nginx)`` paths, installing them once; a string says why they are missing."""
    found = shutil.which("wrk"), shutil.which("nginx", path="/usr/sbin:/sbin:" + os.environ["PATH"])
    if None in found:
        script = BENCH.parent / "scripts" / "install_ops_deps.sh"
        r = subprocess.run(["bash", str(script), "bench"], capture_output=True, text=True)
        if r.returncode:
            return f"wrk/nginx not installed: {(r.stderr or r.stdout).strip()[-300:]}"
        found = shutil.which("wrk"), shutil.which("nginx", path="/usr/sbin:/sbin")
    wrk, nginx = found
    if wrk is None or nginx is None:
        return "wrk/nginx not on PATH after scripts/install_ops_deps.sh bench"
    return wrk, nginx


# ---- nginx --------------------------------------------------------------------------------


def _quoted(body: bytes) -> str:
    text = body.decode()
    if "$" in text or "'" in text or "\\" in text:
        raise ValueError("canned body needs escaping for nginx")
    return f"'{text}'"


def nginx_conf(port: int, home: Path) -> str:
    """Every route the gateways probe or call, answered from memory."""
    canned = Canned()

    def body(raw: bytes) -> bytes:
        return raw.split(b"\r\n\r\n", 1)[1]

    routes = {
        "/v1/chat/completions": ("application/json", body(canned.completion["fast"])),
        "/v1/completions": ("application/json", body(canned.completion["fast"])),
        "/health": ("text/plain", b""),
        **{
            path.decode(): ("application/json", body(raw))
            for path, raw in canned.get.items()
            if path not in (b"/health", b"/metrics")
        },
        "/metrics": ("text/plain; version=0.0.4", body(canned.get[b"/metrics"])),
    }
    locations = "".join(
        f"    location = {path} {{ default_type '{ctype}'; return 200 {_quoted(data)}; }}\n"
        for path, (ctype, data) in routes.items()
    )
    temps = "".join(
        f"  {kind}_temp_path {home}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"daemon off;\nmaster_process off;\nworker_processes 1;\npid {home}/nginx.pid;\n"
        f"error_log {home}/error.log warn;\n"
        "events { worker_connections 8192; }\n"
        "http {\n  access_log off;\n  server_tokens off;\n  tcp_nodelay on;\n"
        "  keepalive_requests 100000000;\n  keepalive_timeout 300s;\n"
        f"  client_body_buffer_size 64k;\n{temps}"
        f"  server {{\n    listen 127.0.0.1:{port} backlog=8192;\n{locations}"
        "    location / { return 404; }\n  }\n}\n"
    )


def _unprivileged() -> list[str]:
    """Run as ``nobody`` when started as root (nginx needs no privilege on a high port)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return []
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]


def start_nginx(nginx: str, tmp: Path) -> tuple[Proc, int]:
    home = Path(tempfile.mkdtemp(prefix="gpupool-nginx-"))  # its own: ``tmp`` is private
    port = free_port()
    conf = home / "nginx.conf"
    conf.write_text(nginx_conf(port, home))
    user = _unprivileged()
    if user:
        shutil.chown(home, "nobody", "nogroup")
    argv = [*user, nginx, "-p", str(home), "-e", str(home / "error.log"), "-c", str(conf)]
    proc = Proc("nginx", argv, RIG_CPU, tmp / "nginx.log").start()
    proc.wait_http(f"http://127.0.0.1:{port}/health", 20)
    return proc, port


# ---- wrk ----------------------------------------------------------------------------------


def lua_script(tmp: Path, headers: dict[str, str]) -> Path:
    body = tmp / "wrk-body.json"
    body.write_bytes(BODY)
    extra = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in headers.items())
    name = "wrk-" + ("-".join(sorted(headers)) or "plain") + ".lua"
    path = tmp / name
    path.write_text(LUA.format(body=body, headers=extra))
    return path


def run_wrk(wrk: str, port: int, script: Path, conns: int, seconds: float) -> dict[str, Any]:
    argv = ["taskset", "-c", str(RIG_CPU), wrk, "-t1", f"-c{conns}", f"-d{seconds:g}s",
            "--latency", "--timeout", "5s", "-s", str(script),
            f"http://127.0.0.1:{port}{PATH}"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30)
    for line in r.stdout.splitlines():
        if line.startswith("WRKJSON "):
            out: dict[str, Any] = json.loads(line[8:])
            out["rps"] = out["requests"] / max(1e-9, out["duration_us"] / 1e6)
            return out
    raise RuntimeError(f"wrk printed no figures (rc {r.returncode}): {r.stderr[-500:]}")


# ---- the phase -----------------------------------------------------------------------------


def _measured(wrk: str, t: Target, script: Path, conns: int, seconds: float) -> dict[str, Any]:
    """One wrk run, with the gateway's CPU time per request (robust where latency is not: a
    busy machine delays a request, it does not make it cost more CPU)."""
    before = oncpu_ns(t.pid) if t.pid is not None else 0
    out = run_wrk(wrk, t.port, script, conns, seconds)
    if t.pid is not None:
        out["cpu_us_per_request"] = (oncpu_ns(t.pid) - before) / 1000 / max(1, out["requests"])
    return out


def _round(wrk: str, t: Target, script: Path, seconds: float, everyone: list[int]) -> dict:
    with alone(t.pid, everyone):
        run_wrk(wrk, t.port, script, 1, 1)  # warm-up (and the resumed process's caches)
        one = _measured(wrk, t, script, 1, seconds)
        many = _measured(wrk, t, script, 32, seconds)
    return {"c1": one, "c32": many}


def _summary(rounds: list[dict[str, Any]], direct: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds; the added latency is taken against direct in the same round."""

    def med(xs: list[float]) -> float:
        return float(statistics.median(xs))

    out: dict[str, Any] = {}
    for q in ("p50", "p99"):
        own = [r["c1"][f"{q}_us"] / 1000 for r in rounds]
        pairs = zip(rounds, direct, strict=True)
        added = [(r["c1"][f"{q}_us"] - d["c1"][f"{q}_us"]) / 1000 for r, d in pairs]
        out[f"{q}_ms"] = med(own)
        out[f"added_{q}_ms"] = med(added)
        out[f"added_{q}_ms_all"] = added
    rps = [r["c32"]["rps"] for r in rounds]
    out["rps_c32"] = med(rps)
    out["rps_c32_all"] = rps
    out["c32_p99_ms"] = med([r["c32"]["p99_us"] / 1000 for r in rounds])
    out["c1_rps"] = med([r["c1"]["rps"] for r in rounds])
    if "cpu_us_per_request" in rounds[0]["c1"]:
        for c in ("c1", "c32"):
            cpu = [r[c]["cpu_us_per_request"] for r in rounds]
            out[f"{c}_cpu_us"], out[f"{c}_cpu_us_all"] = med(cpu), cpu
    out["errors"] = sum(r[c]["errors"] + r[c]["non2xx"] for r in rounds for c in ("c1", "c32"))
    return out


def measure(targets: list[Target], wrk: str, tmp: Path, rounds: int, seconds: float) -> dict:
    """Interleaved rounds over ``targets`` (``direct`` first in the list is nginx itself)."""
    everyone = [t.pid for t in targets if t.pid is not None]
    raw: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    for k in range(rounds):
        order = targets[k % len(targets) :] + targets[: k % len(targets)]
        for t in order:
            script = lua_script(tmp, t.headers)
            raw[t.name].append(_round(wrk, t, script, seconds, everyone))
            c1, c32 = raw[t.name][-1]["c1"], raw[t.name][-1]["c32"]
            cpu = c1.get("cpu_us_per_request")
            line = f"c=1 p50 {c1['p50_us']:5d} µs p99 {c1['p99_us']:5d} µs"
            line += f" cpu {cpu:5.0f} µs/req" if cpu is not None else ""
            print(f"  round {k + 1} {t.name:14s} {line} | c=32 {c32['rps']:8.0f} req/s", flush=True)
    summary = {name: _summary(r, raw["direct"]) for name, r in raw.items()}
    return {"rounds": raw, "summary": summary, "seconds": seconds, "body": BODY.decode()}


def phase(names: list[str], tmp: Path, rounds: int, seconds: float,
          baseline: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Start nginx and a fresh set of gateways in front of it, measure, stop them."""
    found = tools()
    if isinstance(found, str):
        return {"error": found}
    wrk, nginx = found
    wanted = ["direct", *[n for n in names if n in WRK_TARGETS]]
    nginx_proc, port = start_nginx(nginx, tmp)
    home = tmp / "wrk-gateways"
    home.mkdir(exist_ok=True)
    targets: list[Target] = []
    try:
        targets = build(wanted, port, home, home, None, baseline)
        for t in targets:
            t.start()
        for t in targets:
            t.wait(240)
        res = measure(targets, wrk, tmp, rounds, seconds)
        res["versions"] = {t.name: t.version for t in targets}
        res["versions"]["nginx"] = _version([nginx, "-v"]).removeprefix("nginx version: nginx/")
        res["versions"]["wrk"] = _version([wrk, "-v"]).split(" [")[0].removeprefix("wrk ")
        return res
    finally:
        for t in targets:
            t.stop()
        nginx_proc.stop()


def _version(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    text = (r.stdout + r.stderr).strip().splitlines()
    return text[0] if text else "?"


def print_summary(res: dict[str, Any]) -> None:
    if "error" in res:
        print(f"  wrk phase: {res['error']}", flush=True)
        return
    s = res["summary"]
    ref = s.get("vllm-router", {})
    print("  target          p50 ms  p99 ms  added p50/p99 ms   x vllm-router   c=32 req/s")
    for name, v in s.items():
        ratio = v["added_p50_ms"] / ref["added_p50_ms"] if ref.get("added_p50_ms") else None
        rate = v["rps_c32"] / ref["rps_c32"] if ref.get("rps_c32") else None
        print(f"  {name:14s} {v['p50_ms']:7.3f} {v['p99_ms']:7.3f}  "
              f"{v['added_p50_ms']:6.3f} / {v['added_p99_ms']:6.3f}   "
              f"{'' if ratio is None else f'{ratio:5.2f}x'}         "
              f"{v['rps_c32']:8.0f} {'' if rate is None else f'({rate:.2f}x)'}",
              flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="gpupool,vllm-router,sglang-router")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--baseline", default=None, help="A git revision to run as gpupool-base.")
    p.add_argument("--json", type=Path, default=None, help="Write the results here.")
    args = p.parse_args()
    pin_self(RIG_CPU)
    raise_nofile()
    nice(-10)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-wrk-"))
    base = baseline_tree(args.baseline, tmp) if args.baseline else None
    res = phase(args.only.split(","), tmp, args.rounds, args.seconds, base)
    print_summary(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
