"""Where gpupool spends its CPU under load: py-spy samples, summarised by package and function.

Used by ``bench/run.py --profile`` (needs ``.venv/bin/py-spy``); or alone against a running
gateway and upstream:

    .venv/bin/python bench/profile_gateway.py --pid PID --port PORT --rate 600 [--stream]

Two scenarios: non-streaming requests at ``rate`` (about 70 % of the highest sustained rate), and
64-chunk zero-delay streams at a third of it. Writes ``profile.md`` and the raw collapsed stacks
(``profile-*.txt``, loadable in speedscope or flamegraph.pl).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import loadgen
import uvloop
from phases import PATH, body
from rig import BENCH, RIG_CPU, ROOT, pin_self

PYSPY = ROOT / ".venv" / "bin" / "py-spy"


def _frames(stack: str) -> list[tuple[str, str]]:
    """``func (file)`` frames, outermost first, as (file, func)."""
    out = []
    for f in stack.split(";"):
        func, _, rest = f.partition(" (")
        out.append((rest.rstrip(")").split(":")[0], func))
    return out


def _package(file: str) -> str:
    if file.startswith("gpupool/"):
        return "/".join(file.split("/")[:3]).removesuffix(".py")
    if "/" in file:
        return file.split("/")[0]
    return file.removesuffix(".py") or "?"


_BASE = ("gpupool/__main__.py", "gpupool/cli/")  # start-up frames under every sample
_LOOP = "(event loop, server and I/O: no request code of gpupool on the stack)"


def summarise(raw: str) -> dict[str, Any]:
    total = 0
    by_pkg: Counter[str] = Counter()
    pkg_incl: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    owner: Counter[str] = Counter()  # deepest gpupool frame: the code that asked for the work
    owner_pkg: dict[str, Counter[str]] = {}
    inclusive: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = _frames(stack)
        total += count
        file, func = frames[-1]
        pkg = _package(file)
        by_pkg[pkg] += count
        leaf[f"{file}:{func}"] += count
        for p in {_package(f) for f, _ in frames if not f.startswith(_BASE)}:
            pkg_incl[p] += count
        ours = [
            f"{f}:{fn}" for f, fn in frames if f.startswith("gpupool/") and not f.startswith(_BASE)
        ]
        who = ours[-1] if ours else _LOOP
        owner[who] += count
        owner_pkg.setdefault(who, Counter())[pkg] += count
        for name in set(ours):
            inclusive[name] += count

    def top(c: Counter[str], k: int = 15) -> list[tuple[str, float]]:
        return [(name, 100.0 * v / max(1, total)) for name, v in c.most_common(k)]

    detail = {who: top(owner_pkg[who], 4) for who, _ in owner.most_common(10)}
    return {
        "samples": total,
        "by_package": top(by_pkg),
        "package_inclusive": top(pkg_incl),
        "leaf": top(leaf, 20),
        "owner": top(owner, 20),
        "owner_detail": detail,
        "inclusive": top(inclusive, 20),
    }


async def _load(port: int, req: bytes, rate: float, seconds: float) -> loadgen.Step:
    return await loadgen.open_loop(port, req, rate, seconds, grace=3.0)


def record(pid: int, port: int, req: bytes, rate: float, seconds: float, out: Path) -> dict:
    argv = [
        "taskset",
        "-c",
        str(RIG_CPU),
        str(PYSPY),
        "record",
        "--pid",
        str(pid),
        "--rate",
        "250",
        "--duration",
        str(int(seconds)),
        "--format",
        "raw",
        "--nolineno",
        "--nonblocking",
        "--output",
        str(out),
    ]
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)
    step = uvloop.run(_load(port, req, rate, seconds - 1))
    _, err = spy.communicate(timeout=60)
    if spy.returncode or not out.exists():
        return {"error": f"py-spy failed: {err.decode(errors='replace')[-500:]}"}
    res = summarise(out.read_text())
    res["load"] = {
        "rate": rate,
        "ok": step.ok,
        "errors": step.errors,
        "p99_ms": sorted(step.latencies)[int(0.99 * len(step.latencies))] * 1e3
        if step.latencies
        else None,
    }
    return res


def markdown(profiles: dict[str, dict[str, Any]]) -> str:
    out = [
        "# Where gpupool spends its CPU (py-spy)",
        "",
        "Sampled at 250 Hz with `py-spy record --nonblocking --nolineno` while the bench's "
        "open-loop client drove the gateway (one process on CPU1). Percentages are of all "
        "samples of the gateway's busy thread.",
        "",
    ]
    for name, p in profiles.items():
        if "error" in p:
            out += [f"## {name}", "", p["error"], ""]
            continue
        load = p["load"]
        out += [
            f"## {name}: {load['rate']:g} req/s offered, {load['ok']} ok, {load['errors']} "
            f"errors, {p['samples']} samples",
            "",
        ]
        for key, title in (
            (
                "by_package",
                "By package (where the leaf frame is; C code of "
                "uvloop/httptools and system calls show as asyncio)",
            ),
            ("package_inclusive", "By package, inclusive (anywhere on the stack)"),
            (
                "owner",
                "By gpupool function that asked for the work (deepest "
                "gpupool frame; includes the libraries it called)",
            ),
            ("inclusive", "gpupool functions, inclusive"),
            ("leaf", "Hottest leaf functions"),
        ):
            owner = key == "owner"
            out += [
                f"### {title}",
                "",
                "| where | % of samples |" + (" leaf packages under it, % |" if owner else ""),
                "|---|---|" + "---|" * owner,
            ]
            for n, v in p[key]:
                spread = ", ".join(f"{k} {x:.1f}" for k, x in p["owner_detail"].get(n, []))
                out.append(f"| `{n}` | {v:.1f} |" + (f" {spread} |" if owner else ""))
            out.append("")
    return "\n".join(out) + "\n"


def run(pid: int, port: int, out_dir: Path, best_rate: float, quick: bool) -> dict[str, Any]:
    if not PYSPY.exists():
        return {"error": "py-spy not installed (.venv/bin/pip install py-spy)"}
    seconds = 6 if quick else 12
    rate = max(50.0, 0.7 * best_rate)
    scenarios = {
        "non-streaming": (loadgen.request_bytes(port, PATH, body("fast", False)), rate),
        "streaming (64 chunks, zero delay)": (
            loadgen.request_bytes(port, PATH, body("fast", True)),
            rate / 3,
        ),
    }
    profiles = {}
    for i, (name, (req, r)) in enumerate(scenarios.items()):
        raw = out_dir / f"profile-{i + 1}.txt"
        print(f"  profiling {name} at {r:.0f} req/s for {seconds} s ...", flush=True)
        profiles[name] = record(pid, port, req, r, seconds, raw)
    (out_dir / "profile.md").write_text(markdown(profiles))
    return profiles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=float, default=600)
    p.add_argument("--out", type=Path, default=BENCH / "results")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    pin_self(RIG_CPU)
    run(args.pid, args.port, args.out, args.rate / 0.7, args.quick)
    print((args.out / "profile.md").read_text())


if __name__ == "__main__":
    main()
