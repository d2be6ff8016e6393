"""Routing quality on real vLLM: gpupool beside the peers' policies, the same workers behind each.

    .venv/bin/python bench/routing/run.py [--rounds 2] [--quick] [--size flood=96 ...]

Starts the vLLM workers once (a long- and a short-window worker serving a random-weight model
made by ``make_model.py``, prefix caching on), every router in front of them, then runs rounds:
in each round, each workload runs through every router in turn (in a shuffled order, new for each
round and workload), with the workers' prefix caches emptied before each run. Writes
``results.json``, ``results.md`` and one PNG per workload into ``--out``
(``bench/results/routing/``).
On a GPU machine pass the model size, the workers' CPUs/windows and bigger ``--size`` values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # bench/ (rig), after ours

import aiohttp
import pool
import report
import routers
from rig import ROOT, raise_nofile
from workloads import WORKLOADS, Ctx, Sizes

QUICK = {
    "turns": 3,
    "mixed_requests": 16,
    "flood": 32,
    "interactive": 6,
    "uneven_requests": 16,
    "tenants_s": 25.0,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="Smaller workloads (see QUICK).")
    p.add_argument("--routers", default=",".join(routers.ALL))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"Override a workload size: {', '.join(f.name for f in fields(Sizes))}",
    )
    p.add_argument("--model-dir", type=Path, default=ROOT / "bench" / ".models" / "routing-bench")
    p.add_argument(
        "--model",
        default="",
        metavar="ARGS",
        help="Arguments for make_model.py, e.g. '--hidden 256 --layers 4'.",
    )
    p.add_argument(
        "--workers",
        default="long:8192:0,short:2048:1",
        help="name:window:cpus[:gpus:gpu-memory-utilization], comma separated (cpus as for "
        "taskset -c; gpus as for CUDA_VISIBLE_DEVICES: a worker on GPUs).",
    )
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=104,
        help="Cap each worker's KV cache at this many blocks (--num-gpu-blocks-override; 128 "
        "tokens a block on the CPU backend, 16 on GPUs); 0: as --kv-gib or the GPU memory "
        "gives. See workload 1.",
    )
    p.add_argument("--vllm-args", default="", help="Extra vLLM flags for every worker.")
    p.add_argument("--router-cpus", default=f"0-{(os.cpu_count() or 1) - 1}")
    p.add_argument(
        "--slow-worker",
        default="",
        help="The worker workload 4 slows (default: each in turn, round by round).",
    )
    p.add_argument(
        "--serve-workers",
        action="store_true",
        help="Only start the workers and keep them until interrupted (for --attach); writes "
        "their ports and KV caches to --out/workers.json.",
    )
    p.add_argument(
        "--attach",
        default="",
        metavar="NAME=PORT,...",
        help="Use workers already running (started by --serve-workers), or FILE.json: the "
        "workers.json --serve-workers writes (their ports and KV caches).",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "routing")
    p.add_argument("--report-only", action="store_true", help="Redraw from --out/results.json.")
    p.add_argument(
        "--resume",
        action="store_true",
        help="Add --rounds rounds to --out/results.json's (same sizes, the next rounds' prompts): "
        "a run split over several commands, as on the GPU lane's 10-minute runs.",
    )
    return p.parse_args(argv)  # fmt: skip


def sizes(args: argparse.Namespace) -> Sizes:
    sz = Sizes(**(QUICK if args.quick else {}))
    for item in args.size:
        key, _, value = item.partition("=")
        current = getattr(sz, key)  # AttributeError names a bad key
        setattr(sz, key, type(current)(value))
    return sz


def make_model(args: argparse.Namespace) -> None:
    cmd = [str(pool.VLLM_PY), str(Path(__file__).parent / "make_model.py"), str(args.model_dir),
           *args.model.split()]  # fmt: skip
    subprocess.run(cmd, check=True)


def worker_specs(args: argparse.Namespace) -> list[pool.WorkerSpec]:
    specs = []
    events = routers.wants_events(args.routers.split(","))
    for item in args.workers.split(","):
        name, window, cpus, *gpu = item.split(":")
        extra = args.vllm_args.split()
        if args.kv_blocks:
            extra += ["--num-gpu-blocks-override", str(args.kv_blocks)]
        gpus, memory = (gpu[0], float(gpu[1])) if gpu else ("", 0.0)
        specs.append(pool.WorkerSpec(name, int(window), cpus, args.max_num_seqs,
                                     args.batched_tokens, extra, gpus, memory,
                                     events))  # fmt: skip
    return specs


def tokens_per_word(w: pool.Worker) -> float:
    from workloads import text

    sample = text(random.Random(0), 1000, 1.0)
    body = json.dumps({"model": pool.SERVED, "prompt": sample}).encode()
    req = urllib.request.Request(w.url + "/tokenize", data=body,
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        count = json.loads(r.read())["count"]
    return float(count) / len(sample.split())


async def calibrate(sz: Sizes, workers: list[pool.Worker]) -> float:
    """The long worker's prefill of a long prompt, idle (median of three, after one to warm
    up); sets workload 2's gap from it unless ``--size mixed_gap_s`` did."""
    from workloads import text

    w = max(workers, key=lambda w: w.spec.window)
    rng = random.Random("calibrate")
    took = []
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            prompt = text(rng, sz.long_tokens, sz.tokens_per_word)
            body = {"model": pool.SERVED, "max_tokens": 1, "stream": True,
                    "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
            t0 = time.perf_counter()
            async with s.post(w.url + "/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        break
            took.append(time.perf_counter() - t0)
    prefill = sorted(took[1:])[1]
    if not sz.mixed_gap_s:
        sz.mixed_gap_s = round(prefill / (sz.mixed_long_load * sz.mixed_long_every), 3)
    print(f"  a {sz.long_tokens}-token prefill on {w.name}: {prefill * 1000:.0f} ms; workload 2's "
          f"gap {sz.mixed_gap_s} s", flush=True)  # fmt: skip
    return prefill


async def calibrate_tenants(sz: Sizes, workers: list[pool.Worker]) -> dict[str, float]:
    """Workload 5's pace: on the idle first worker, a tenant-shaped request's whole latency
    with its prefix not cached and then cached (medians of three, after one to warm up); sets
    ``tenants_gap_s`` unless ``--size tenants_gap_s`` did."""
    from workloads import text

    w = workers[0]
    rng = random.Random("calibrate-tenants")
    miss, hit = [], []
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            prefix = text(rng, sz.tenant_prefix_tokens, sz.tokens_per_word)
            for took in (miss, hit):
                msgs = [{"role": "system", "content": prefix},
                        {"role": "user", "content": text(rng, sz.question_tokens,
                                                         sz.tokens_per_word)}]  # fmt: skip
                body = {"model": pool.SERVED, "max_tokens": sz.tenants_max_tokens,
                        "ignore_eos": True, "messages": msgs}  # fmt: skip
                t0 = time.perf_counter()
                async with s.post(w.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                took.append(time.perf_counter() - t0)
    m, h = sorted(miss[1:])[1], sorted(hit[1:])[1]
    if not sz.tenants_gap_s:
        sz.tenants_gap_s = round((m + h) / 2 / (len(workers) * sz.tenants_load), 3)
    print(
        f"  a tenant's request on idle {w.name}: {m * 1000:.0f} ms prefix not cached, "
        f"{h * 1000:.0f} ms cached; workload 5's mean gap {sz.tenants_gap_s} s",
        flush=True,
    )
    return {"miss_s": m, "hit_s": h}


async def warm(targets: list[routers.Router], workers: list[pool.Worker]) -> None:
    """Two tiny requests through each, as the workloads' own tenant: one with no key would be
    another tenant to gpupool, active for its reserve window, and hold a seat of every worker
    back from workload 1 for the first round."""
    body = {"model": pool.SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": "Bearer sk-bench"}
    async with aiohttp.ClientSession() as s:
        for url in [w.url for w in workers] + [r.url for r in targets]:
            for _ in range(2):
                async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()


async def measure(args: argparse.Namespace, sz: Sizes, targets: list[routers.Router],
                  workers: list[pool.Worker], res: dict[str, Any]) -> None:  # fmt: skip
    await warm(targets, workers)
    names = [n for n in args.workloads.split(",") if n]
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # no keep-alive effects (Nagle)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        done = res.get("rounds", 0)
        for r in range(done, done + args.rounds):
            for wl in names:
                order = list(targets)  # a new order each time: no router always follows another
                random.Random(f"{r}-{wl}").shuffle(order)
                res.setdefault("orders", []).append([wl, [t.name for t in order]])
                for target in order:
                    pool.reset_prefix_cache(workers)
                    slow = args.slow_worker or workers[r % len(workers)].name
                    ctx = Ctx(session, workers, sz, seed=1000 * r + 7, slow_worker=slow)
                    t0 = time.monotonic()
                    out = await WORKLOADS[wl](ctx, target.url)
                    out["seconds"] = time.monotonic() - t0
                    res["runs"].setdefault(wl, {}).setdefault(target.name, []).append(out)
                    print(f"  round {r + 1} {wl:10s} {target.name:28s} {report.brief(wl, out)}",
                          flush=True)  # fmt: skip
                    report.save(res, args.out)
                    await asyncio.sleep(1.0)
            res["rounds"] = r + 1  # what --resume counts from: saved with the round's last run
            report.save(res, args.out)


def attach(spec: str) -> dict[str, dict[str, Any]]:
    """--attach: "NAME=PORT,..." or the path of --serve-workers' workers.json."""
    if spec.endswith(".json"):
        listing: dict[str, dict[str, Any]] = json.loads(Path(spec).read_text())
        return listing
    return {k: {"port": int(v)} for k, v in (item.split("=") for item in spec.split(",") if item)}


def attach_events(workers: list[pool.Worker], attached: dict[str, dict[str, Any]]) -> None:
    """Attached workers publish where --serve-workers' run had them (its workers.json)."""
    for w in workers:
        if w.proc is None and attached[w.name].get("events"):
            w.events = tuple(attached[w.name]["events"])  # type: ignore[assignment]


def earlier(args: argparse.Namespace) -> dict[str, Any] | None:
    """With --resume, the run so far in --out (None: start afresh)."""
    path = args.out / "results.json"
    if not args.resume or not path.exists():
        return None
    res: dict[str, Any] = json.loads(path.read_text())
    return res


def serve(args: argparse.Namespace, workers: list[pool.Worker], kv: dict[str, Any]) -> None:
    """--serve-workers: list them in --out/workers.json, then wait for SIGTERM (a background
    job ignores SIGINT)."""
    listing = {w.name: {"port": w.port, "kv_tokens": kv[w.name], "events": w.events}
               for w in workers}  # fmt: skip
    (args.out / "workers.json").write_text(json.dumps(listing))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


def fresh(args: argparse.Namespace, sz: Sizes, specs: list[pool.WorkerSpec],
          targets: list[routers.Router]) -> dict[str, Any]:  # fmt: skip
    return {
        "sizes": asdict(sz),
        "args": {k: str(v) for k, v in vars(args).items()},
        "workers": [asdict(s) for s in specs],
        "model": json.loads((args.model_dir / "config.json").read_text()),
        "dtype": "bfloat16" if specs[0].gpus else pool.cpu_dtype(),  # GPUs: the model's
        "versions": {t.name: t.version for t in targets},
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "order": [t.name for t in targets],
        "runs": {},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    before = earlier(args)
    sz = Sizes(**before["sizes"]) if before else sizes(args)
    make_model(args)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-routing-"))
    print(f"  logs in {tmp}", flush=True)
    specs = worker_specs(args)
    attached = attach(args.attach)
    ports = {name: w["port"] for name, w in attached.items()}
    workers = pool.start(specs, args.model_dir, tmp, args.kv_gib, ports)
    attach_events(workers, attached)
    targets: list[routers.Router] = []
    try:
        t0 = time.monotonic()
        for w in workers:
            pool.wait(w, 900)
        kv = {w.name: pool.kv_tokens(w) or attached.get(w.name, {}).get("kv_tokens")
              for w in workers}  # fmt: skip
        print(f"  {len(workers)} vLLM workers ready after {time.monotonic() - t0:.0f} s: "
              + ",".join(f"{w.name}={w.port}" for w in workers)
              + f"; KV cache tokens {kv}", flush=True)  # fmt: skip
        if args.serve_workers:
            serve(args, workers, kv)
        res = before
        if res is None:
            sz.tokens_per_word = tokens_per_word(workers[0])
            long_prefill = asyncio.run(calibrate(sz, workers))
            tenant_cost = (asyncio.run(calibrate_tenants(sz, workers))
                           if "tenants" in args.workloads.split(",") else {})  # fmt: skip
        targets = routers.build(
            args.routers.split(","), workers, tmp, tmp, args.router_cpus, args.model_dir
        )
        for t in targets:
            t.proc.start()
        for t in targets:
            t.proc.wait_http(t.url + t.ready_path, 180)
        if res is None:
            res = fresh(args, sz, specs, targets)
            res |= {"kv_tokens": kv, "long_prefill_s": long_prefill, "tenant_cost": tenant_cost}
        asyncio.run(measure(args, sz, targets, workers, res))
        res["wall_s"] = res.get("wall_s", 0.0) + time.monotonic() - t0
        return res
    finally:
        for t in targets:
            t.proc.stop()
        for w in workers:
            if w.proc is not None:
                w.proc.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        res = json.loads((args.out / "results.json").read_text())
    else:
        raise_nofile()
        res = run(args)
    report.save(res, args.out, final=True)
    print(f"wrote {args.out}/results.md, results.json and the plots", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
