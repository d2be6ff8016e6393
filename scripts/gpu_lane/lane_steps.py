"""The steps both phases share: hardware, plan, launch (with times and cache), planner, stop."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import lane_gpu
from lane_ctx import Ctx, cache_stats, parse_json, versions
from lane_gateway import Gateway
from lane_util import pct, sh

GiB = 2**30


async def hardware(ctx: Ctx) -> dict[str, Any]:
    gpus_json = await ctx.gpupool_async("gpus", "--json")
    check = await ctx.gpupool_async("check", "--config", str(ctx.config_path))
    ctx.baseline_mib = lane_gpu.used_mib()
    return {
        "nvidia_smi_L": sh(["nvidia-smi", "-L"])["out"].strip(),
        "gpus": lane_gpu.gpus(),
        "gpupool_gpus": parse_json(gpus_json["out"]) or gpus_json,
        "gpupool_check": {"rc": check["rc"], "out": check["out"][-4000:]},
        "versions": versions(),
        "cpus": os.cpu_count(),
        "baseline_used_mib": ctx.baseline_mib,
    }


async def plan(ctx: Ctx) -> dict[str, Any]:
    """`gpupool plan --config` for every launched worker, GPU memory as nvidia-smi reports it."""
    gpus = lane_gpu.gpus()
    extra = ["--gpu-memory-gb", f"{gpus[0]['memory_total_mib'] / 1024:.2f}"] if gpus else []
    r = await ctx.gpupool_async("plan", "--config", str(ctx.config_path), "--json", *extra)
    data = parse_json(r["out"])
    if not isinstance(data, dict):
        return {"rc": r["rc"], "error": r["out"][-2000:]}
    out: dict[str, Any] = {"rc": r["rc"], "findings": data.get("findings", [])}
    for w in data.get("workers", []):
        p = w.get("plan") or {}
        mem, kv = p.get("memory_per_gpu", {}), p.get("kv_cache", {})
        out[w["name"]] = {
            "verdict": p.get("verdict"),
            "budget_gib": _gib(mem.get("budget_bytes")),
            "weights_gib": _gib(mem.get("weights_bytes")),
            "overhead_gib": _gib(mem.get("overhead_bytes")),
            "kv_budget_gib": _gib(mem.get("kv_budget_bytes")),
            "kv_tokens": kv.get("tokens"),
            "block_size": kv.get("block_size"),
            "max_concurrency": kv.get("max_concurrency"),
            "findings": [f.get("message", f) for f in w.get("findings", [])][:6],
        }
    return out


def _gib(n: Any) -> float | None:
    return round(n / GiB, 3) if isinstance(n, int | float) else None


async def launch(ctx: Ctx, label: str = "launch") -> dict[str, Any]:
    """Start gpupool; wait for every worker; times, compile figures, caches, GPU processes."""
    ctx.gw = Gateway(ctx.lane, ctx.config_path, ctx.port)
    cache_before = cache_stats(ctx.state_dir)
    ctx.gw.start(ctx.lane.work / f"gateway-{ctx.lane.phase}.log")
    names = ctx.worker_names
    caches: dict[str, Any] = {"before": cache_before}
    for name in names:  # in start order: snapshot the cache as each becomes ready
        budget = max(10.0, ctx.lane.remaining() - 60)
        ok = await ctx.gw.wait_states([name], {"ready"}, budget)
        caches[f"after {name} ready"] = cache_stats(ctx.state_dir)
        ctx.lane.say(f"{label}: {name} ->", ctx.gw.state(name), "ok" if ok else "NOT READY")
    ready = await ctx.gw.wait_states(names, {"ready"}, 1)
    t_start = ctx.gw.started_at
    workers = {n: _worker_launch(ctx, n, t_start) for n in names}
    return {
        "all_ready": ready,
        "ready_after_s": _round(max((w["ready_s"] or 0) for w in workers.values()))
        if ready
        else None,
        "workers": workers,
        "caches": caches,
        "gpu_processes": lane_gpu.apps_by_worker(ctx.gw.guards()),
        "gpu_used_mib": lane_gpu.used_mib(),
        "timeline": list(ctx.gw.timeline),
    }


def _worker_launch(ctx: Ctx, name: str, t0: float) -> dict[str, Any]:
    gw = ctx.gw
    assert gw is not None
    launches = ctx.launches(name)
    last = launches[-1] if launches else {"figures": {}, "lines": []}
    w = gw.workers.get(name, {})
    return {
        "state": gw.state(name),
        "starting_s": _since(gw.first(name, "starting", t0), t0),
        "warming_s": _since(gw.first(name, "warming", t0), t0),
        "ready_s": _since(gw.first(name, "ready", t0), t0),
        "window": w.get("max_model_len"),
        "gpus": w.get("gpus"),
        "last_error": w.get("last_error"),
        "figures": last["figures"],
        "log": last["lines"],
    }


def _since(t: float | None, t0: float) -> float | None:
    return _round(t - t0) if t is not None else None


def _round(x: float | None) -> float | None:
    return round(x, 1) if x is not None else None


async def planner(ctx: Ctx) -> dict[str, Any]:
    """`gpupool plan` against what vLLM logged, per worker (KV tokens and bytes; target 2 %)."""
    planned = ctx.lane.results.get("plan", {})
    out: dict[str, Any] = {}
    for name in ctx.worker_names:
        p = planned.get(name) or {}
        launches = ctx.launches(name)
        f = launches[0]["figures"] if launches else {}
        logged_tokens, logged_gib = f.get("kv_cache_tokens"), f.get("kv_cache_gib")
        out[name] = {
            "kv_tokens_plan": p.get("kv_tokens"),
            "kv_tokens_vllm": logged_tokens,
            "kv_tokens_err_pct": _err(p.get("kv_tokens"), logged_tokens),
            "kv_gib_plan": p.get("kv_budget_gib"),
            "kv_gib_vllm": logged_gib,
            "kv_gib_err_pct": _err(p.get("kv_budget_gib"), logged_gib),
            "weights_gib_plan": p.get("weights_gib"),
            "weights_gib_vllm": f.get("weights_gib"),
            "block_size_plan": p.get("block_size"),
            "block_size_vllm": f.get("attention_block_size"),
            "mamba_page_padding_pct": f.get("mamba_page_padding_pct"),
        }
        errs = [out[name]["kv_tokens_err_pct"], out[name]["kv_gib_err_pct"]]
        known = [abs(e) for e in errs if e is not None]
        out[name]["within_2pct"] = bool(known) and max(known) <= 2.0
    return out


def _err(plan_value: Any, logged: Any) -> float | None:
    if not isinstance(plan_value, int | float) or not isinstance(logged, int | float):
        return None
    return pct(float(plan_value), float(logged))


async def stop(ctx: Ctx, label: str = "stop") -> dict[str, Any]:
    """SIGTERM gpupool; then: until the GPUs are back to the baseline, what is left."""
    if ctx.gw is None:
        return {"skipped": "gpupool was not started"}
    before = lane_gpu.used_mib()
    stopped = await ctx.gw.stop()
    await ctx.gw.close()
    t0 = time.monotonic()
    base = ctx.baseline_mib or [0] * len(before)
    used = lane_gpu.used_mib()
    while time.monotonic() - t0 < 30 and any(u > b + 64 for u, b in zip(used, base, strict=False)):
        await asyncio.sleep(0.5)
        used = lane_gpu.used_mib()
    return {
        **stopped,
        "gpu_used_mib_before": before,
        "gpu_used_mib_after": used,
        "baseline_mib": base,
        "freed_to_baseline_s": round(time.monotonic() - t0, 1),
        "all_freed": all(u <= b + 64 for u, b in zip(used, base, strict=False)),
        "gpu_processes_left": lane_gpu.apps(),
        "vllm_processes_left": _vllm_processes(),
    }


def _vllm_processes() -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm" in cmd and "check.py" not in cmd:
            out.append(f"{entry} {cmd[:120]}")
    return out
