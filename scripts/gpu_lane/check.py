"""The GPU lane's check: gpupool with real vLLM on the machine's GPUs, one phase per run.

    python3 scripts/gpu_lane/check.py --phase dense --shape DIR --config FILE [--out DIR]

``--shape`` is a directory with a model's ``config.json`` (served with dummy weights and an offline
tokenizer); ``--config`` a gpupool config whose launched workers serve it. Steps run in priority
order while the time budget lasts; a step that does not fit is listed under ``not_run``. Results
go to ``OUT/result-<phase>.json`` (rewritten after every step, so a run cut short still reports),
``OUT/report-<phase>.md``, ``OUT/log-<phase>.txt`` and the worker logs. ``report.py`` turns the
JSON into ``docs/gpu/`` and the table in ``docs/gpu.md``. scripts/gpu_lane/README.md has the
whole procedure.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import shutil
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # make_tiny_models, for a tokenizer when none is carried

import lane_dense  # noqa: E402
import lane_gpu  # noqa: E402
import lane_hybrid  # noqa: E402
import lane_init  # noqa: E402
import lane_kvsleep  # noqa: E402
import lane_sleep  # noqa: E402
import lane_steps  # noqa: E402
import lane_tput  # noqa: E402
import report  # noqa: E402
from lane_ctx import Ctx  # noqa: E402
from lane_gateway import effective_config, prepare_model  # noqa: E402
from lane_util import Lane  # noqa: E402

Step = tuple[str, Callable[[Ctx], Awaitable[dict[str, Any]]], float, bool]
STOP_RESERVE_S = 35.0

# (name, step, seconds it needs at least, needs gpupool running), in priority order
DENSE: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("plan", lane_steps.plan, 5, False),
    ("launch", lane_steps.launch, 120, False),
    ("routing", lane_dense.routing, 10, True),
    ("planner", lane_steps.planner, 0, False),
    ("throughput", lane_dense.throughput, 60, True),
    ("ttft", lane_dense.ttft, 10, True),
    ("tp2", lane_dense.tp2, 5, True),
    ("kill", lane_dense.kill, 90, True),
    ("drain", lane_dense.drain, 90, True),
    ("affinity", lane_dense.affinity, 40, True),
    ("stop", lane_steps.stop, 0, False),
]
HYBRID: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("plan", lane_steps.plan, 5, False),
    ("launch", lane_steps.launch, 150, False),
    ("planner", lane_steps.planner, 0, False),
    ("pitfall_cold", partial(lane_hybrid.first_requests, cache="cold"), 30, True),
    ("stop_cold", partial(lane_steps.stop, label="stop_cold"), 0, False),
    ("launch_warm", partial(lane_steps.launch, label="launch_warm"), 120, False),
    ("pitfall_warm", partial(lane_hybrid.first_requests, cache="warm"), 30, True),
    ("stop", lane_steps.stop, 0, False),
]
# the dense model again, for throughput alone: steady-state (closed loop, vLLM's token counters)
THROUGHPUT: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("launch", lane_steps.launch, 120, False),
    ("steady", lane_tput.steady, 120, True),
    ("single", lane_tput.single, 60, True),
    ("ttft", lane_dense.ttft, 10, True),
    ("stop", lane_steps.stop, 0, False),
]
# `gpupool init` on the machine's GPUs (NVML) for the dense model, then served as written
INIT: list[Step] = [
    ("init", lane_init.init, 5, False),
    ("hardware", lane_steps.hardware, 5, False),
    ("plan", lane_steps.plan, 5, False),
    ("launch", lane_steps.launch, 120, False),
    ("request", lane_init.request, 5, True),
    ("planner", lane_steps.planner, 0, False),
    ("stop", lane_steps.stop, 0, False),
]
# issue 28: two 8B-shaped models taking turns on one GPU (vLLM's sleep mode), lane_sleep.py; level 2
# is SLEEP_L2's (these workers load dummy weights, which vLLM cannot reload)
SLEEP: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("launch", lane_sleep.launch, 150, False),
    ("switch_l1", lane_sleep.switch_l1, 30, True),
    ("cold_restart", lane_sleep.cold_restart, 100, True),
    ("alternate", lane_sleep.alternate, 60, True),
    ("idle", lane_sleep.idle, 50, True),
    ("mixed", lane_sleep.mixed, lane_sleep.MIXED_S + 20, True),
    ("stop", lane_steps.stop, 0, False),
]
# issue 28: the hybrid MoE beside a dense 8B in one swap group (configs/sleep-hybrid-1gpu.yaml);
# after 5 switches the hybrid is the one awake, so `cold_restart` restarts the hybrid
SLEEP_HYBRID: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("launch", lane_sleep.launch, 200, False),
    ("switch_l1", lane_sleep.switch_l1, 30, True),
    ("cold_restart", lane_sleep.cold_restart, 100, True),
    ("alternate", partial(lane_sleep.alternate, n=20), 40, True),
    ("stop", lane_steps.stop, 0, False),
]
# issue 28, level 2 on real-format weights (configs/sleep-l2-1gpu.yaml): vLLM cannot reload dummy
# weights, so `weights` writes a random safetensors checkpoint of the 8B shape first
SLEEP_L2: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("weights", lane_sleep.weights, 60, False),
    ("launch", lane_sleep.launch, 120, False),
    ("switch_l2", lane_sleep.switch_l2, 40, True),
    ("pause", lane_sleep.pause, 90, True),
    ("stop", lane_steps.stop, 0, False),
]
# issue 28, seed 000's shape at an RTX 5090's proportions (configs/sleep-5090-1gpu.yaml): a 4-bit
# hybrid MoE and a dense 8B, each in 0.19 of the H200 (26.7 GiB: 0.83 of a 32 GB card)
SLEEP_5090: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("launch", lane_sleep.launch, 200, False),
    ("switch_l1", lane_sleep.switch_l1, 30, True),
    ("alternate", partial(lane_sleep.alternate, n=20), 40, True),
    ("stop", lane_steps.stop, 0, False),
]
# issue 34: precise routing across a sleep (configs/sleep-kv-1gpu.yaml, lane_kvsleep.py): the
# sleeping worker's index emptied, the wake's answer predicted uncached, the next one cached again
SLEEP_KV: list[Step] = [
    ("hardware", lane_steps.hardware, 5, False),
    ("launch", lane_sleep.launch, 120, False),
    ("kv_sleep", lane_kvsleep.kv_sleep, 40, True),
    ("stop", lane_steps.stop, 0, False),
]
PHASES = {"dense": DENSE, "dense-kv": DENSE, "hybrid": HYBRID, "throughput": THROUGHPUT,
          "init": INIT, "sleep": SLEEP, "sleep-hybrid": SLEEP_HYBRID, "sleep-l2": SLEEP_L2,
          "sleep-5090": SLEEP_5090, "sleep-kv": SLEEP_KV}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--phase", choices=sorted(PHASES), required=True)
    p.add_argument("--shape", type=Path, required=True, help="a directory with config.json")
    p.add_argument("--config", type=Path, required=True, help="the gpupool config to serve")
    p.add_argument("--out", type=Path, default=Path("/tmp/lane-out"))
    p.add_argument("--work", type=Path, default=Path("/tmp/lane"))
    p.add_argument("--tokenizer", type=Path, default=HERE / "tokenizer")
    p.add_argument("--budget-s", type=float, default=560, help="the whole phase, stop included")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--only", default="", help="comma-separated steps to run (others skipped)")
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[Lane, Path, dict[str, Any], Path]:
    work = args.work / args.phase
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if os.environ.get("LANE_SHARE_CACHE") == "1":
        # phases run one after another share gpupool's GPU-keyed compile/Triton cache (as one
        # machine's state dir would), so a shape served before starts warm; off by default: the
        # hybrid phase measures a cold cache on purpose
        (args.work / "cache").mkdir(parents=True, exist_ok=True)
        (work / "state").mkdir()
        (work / "state" / "cache").symlink_to(args.work / "cache")
    args.out.mkdir(parents=True, exist_ok=True)
    lane = Lane(args.phase, args.out, work, time.monotonic() + args.budget_s)
    lane.log_path.unlink(missing_ok=True)
    model_dir = prepare_model(args.shape, args.tokenizer, work / "model")

    def shape_dir(name: str) -> Path:
        return prepare_model(HERE / "shapes" / name, args.tokenizer, work / f"model-{name}")

    cfg = effective_config(args.config, model_dir, work / "state", args.port, shape_dir)
    config_path = work / "gpupool.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    lane.put(
        "meta",
        {
            "phase": args.phase,
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "shape": args.shape.name,
            "config": args.config.name,
            "model_config": _json(args.shape / "config.json"),
            "effective_config": cfg,
            "budget_s": args.budget_s,
            # the gpupool this run measures (fingerprint; commit and clean where git is at hand):
            # report.py turns it into meta.commit / meta.clean when it publishes the result
            "gpupool_tree": report.tree_identity(),
        },
    )
    return lane, config_path, cfg, work / "state"


def _json(path: Path) -> Any:
    import json

    return json.loads(path.read_text())


async def run_steps(ctx: Ctx, steps: list[Step], only: set[str]) -> None:
    lane = ctx.lane
    not_run: dict[str, str] = {}
    for name, fn, need_s, needs_gw in steps:
        reason = _skip_reason(ctx, name, need_s, needs_gw, only)
        if reason:
            not_run[name] = reason
            lane.say(f"skip {name}: {reason}")
            lane.put("not_run", not_run)
            continue
        lane.say(f"step {name} (left {lane.remaining():.0f} s)")
        t0 = time.monotonic()
        try:
            result = await fn(ctx)
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            lane.say(f"step {name} FAILED: {type(e).__name__}: {e}")
        result["step_s"] = round(time.monotonic() - t0, 1)
        lane.put(name, result)
    lane.put("not_run", not_run)


def _skip_reason(ctx: Ctx, name: str, need_s: float, needs_gw: bool, only: set[str]) -> str:
    if only and name not in only and not name.startswith("stop"):
        return "not selected (--only)"
    if needs_gw and (ctx.gw is None or not ctx.gw.alive()):
        return "gpupool is not running"
    if name.startswith("stop"):
        return ""
    if ctx.lane.remaining() - STOP_RESERVE_S < need_s:
        return f"out of time ({ctx.lane.remaining():.0f} s left, needs {need_s:.0f} s)"
    return ""


def copy_logs(ctx: Ctx) -> None:
    """Worker and gateway logs to OUT, without CUDA-graph progress lines, at most 4 MiB each."""
    sources = [ctx.log_path(n) for n in ctx.worker_names]
    sources.append(ctx.lane.work / f"gateway-{ctx.lane.phase}.log")
    for src in sources:
        if not src.exists():
            continue
        lines = [
            ln
            for ln in src.read_text(errors="replace").splitlines()
            if "Capturing CUDA graph" not in ln and "it/s]" not in ln
        ]
        text = "\n".join(lines)[-4 * 2**20 :]
        name = src.name if src.name.startswith("gateway") else f"worker-{src.name}"
        (ctx.lane.out / name).write_text(text)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lane, config_path, cfg, state_dir = setup(args)
    sampler = lane_gpu.Sampler(lane.t0).start()
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits) as client:
        ctx = Ctx(lane, config_path, cfg, state_dir, client, sampler, args.port)
        only = {s for s in args.only.split(",") if s}
        try:
            await run_steps(ctx, PHASES[args.phase], only)
        finally:
            if ctx.gw is not None and ctx.gw.alive():
                lane.put("stop_emergency", await lane_steps.stop(ctx))
            sampler.stop()
            lane.put("gpu_memory_timeline", sampler.thin(5.0))
            lane.put("elapsed_s", round(lane.elapsed(), 1))
            copy_logs(ctx)
            report_path = lane.out / f"report-{args.phase}.md"
            report_path.write_text(report.render_phase(lane.results))
            lane.say("report:", report_path)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
