"""The sleep phase (issue 28): two 8B-shaped models taking turns on one GPU through gpupool.

Steps: ``launch`` (start-up in turn: one ends ready, the other asleep), ``switch_l1`` (request
sent → first token for the sleeping model, level 1: the awake one's sleep plus this one's
wake), ``cold_restart`` (the same through a restart of the worker: what a switch costs without
sleep mode), ``alternate`` (50 requests alternating between the models: every one a switch; no
failure allowed, GPU memory sampled against the card), ``switch_l2`` (level 2: the worker put to
sleep with ``?level=2`` wakes by reloading its weights). Each step also gives the GPU's peak
memory while it ran and gpupool's swap metrics.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lane_gpu
from lane_ctx import Ctx
from lane_gateway import Gateway

N_SWITCHES = 5
N_ALTERNATE = 50
N_LEVEL2 = 3
PROMPT = "Write one sentence about the sea."


async def launch(ctx: Ctx) -> dict[str, Any]:
    """Start gpupool: the group's workers start one after another; one ends awake."""
    ctx.gw = gw = Gateway(ctx.lane, ctx.config_path, ctx.port)
    gw.start(ctx.lane.work / f"gateway-{ctx.lane.phase}.log")
    names = ctx.worker_names
    settled = await gw.wait_states(names, {"ready", "asleep"}, max(10.0, ctx.lane.remaining() - 60))
    states = {n: gw.state(n) for n in names}
    t0 = gw.started_at
    return {
        "settled": settled and sorted(states.values()) == ["asleep", "ready"],
        "states": states,
        "settled_after_s": round(max(e["t"] for e in gw.timeline) - t0, 1) if gw.timeline else None,
        "workers": {n: _first_times(gw, n, t0) for n in names},
        "gpu_used_mib": lane_gpu.used_mib(),
        "timeline": list(gw.timeline),
    }


def _first_times(gw: Gateway, name: str, t0: float) -> dict[str, Any]:
    out = {}
    for state in ("starting", "warming", "ready", "falling_asleep", "asleep"):
        t = gw.first(name, state, t0)
        out[f"{state}_s"] = round(t - t0, 1) if t is not None else None
    return out


async def _workers(ctx: Ctx) -> dict[str, dict[str, Any]]:
    r = await ctx.client.get(ctx.gateway().url + "/admin/workers", timeout=30)
    return {w["name"]: w for w in r.json()["data"]}


async def _models(ctx: Ctx) -> tuple[str, str]:
    """(the awake model, a sleeping one)."""
    ws = await _workers(ctx)
    awake = next(w["model"] for w in ws.values() if w["state"] == "ready")
    asleep = next(w["model"] for w in ws.values() if w["model"] != awake)
    return awake, asleep


async def first_token(ctx: Ctx, model: str, max_tokens: int = 16) -> dict[str, Any]:
    """A streamed completion: request sent → first token, and the whole reply."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.monotonic()
    ttft = None
    chunks = 0
    try:
        async with ctx.client.stream(
            "POST", ctx.gateway().url + "/v1/completions", json=body, timeout=600
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text":"' in line.replace(" ", ""):
                    chunks += 1
                    if ttft is None:
                        ttft = time.monotonic() - t0
            status = r.status_code
    except Exception as e:  # recorded as the request's failure
        return {"model": model, "ok": False, "error": f"{type(e).__name__}: {e}"}
    ok = status == 200 and ttft is not None and chunks >= 1
    return {"model": model, "ok": ok, "status": status, "ttft_s": _r(ttft),
            "total_s": _r(time.monotonic() - t0), "chunks": chunks}  # fmt: skip


async def switch_l1(ctx: Ctx) -> dict[str, Any]:
    t_from = ctx.lane.elapsed()
    switches, warm = [], []
    for _ in range(N_SWITCHES):
        if ctx.lane.remaining() < 120:
            break
        _awake, asleep = await _models(ctx)
        switches.append(await first_token(ctx, asleep))  # sleeps `awake`, wakes `asleep`
        warm.append(await first_token(ctx, asleep))  # the same model, now awake
    return {
        "switch_ttft": _stats([s.get("ttft_s") for s in switches]),
        "warm_ttft": _stats([s.get("ttft_s") for s in warm]),
        "failures": sum(not s["ok"] for s in switches + warm),
        "switches": switches,
        **await _swap_metrics(ctx),
        **_memory(ctx, t_from),
    }


async def cold_restart(ctx: Ctx) -> dict[str, Any]:
    """The awake worker restarted (what a switch costs without sleep mode): request sent at the
    restart → first token."""
    t_from = ctx.lane.elapsed()
    ws = await _workers(ctx)
    name = next(n for n, w in ws.items() if w["state"] == "ready")
    model = ws[name]["model"]
    t0 = time.monotonic()
    r = await ctx.gateway().admin(f"/admin/workers/{name}/restart", "POST", limit_s=120)
    reply = await first_token(ctx, model)
    total = time.monotonic() - t0
    return {
        "worker": name,
        "restart_status": r["status"],
        "restart_to_first_token_s": _r(total),
        "request": reply,
        **_memory(ctx, t_from),
    }


async def alternate(ctx: Ctx) -> dict[str, Any]:
    t_from = ctx.lane.elapsed()
    awake, asleep = await _models(ctx)
    replies = []
    for i in range(N_ALTERNATE):
        if ctx.lane.remaining() < 60:
            break
        replies.append(await first_token(ctx, asleep if i % 2 == 0 else awake, max_tokens=8))
    ok = [r for r in replies if r["ok"]]
    return {
        "requests": len(replies),
        "failures": len(replies) - len(ok),
        "ttft": _stats([r.get("ttft_s") for r in ok]),
        "failed": [r for r in replies if not r["ok"]][:5],
        **await _swap_metrics(ctx),
        **_memory(ctx, t_from),
    }


async def switch_l2(ctx: Ctx) -> dict[str, Any]:
    """Level 2: the awake worker is put to sleep with ?level=2 (weights dropped), the other woken,
    then a request for the first: the other's level-1 sleep plus this one's level-2 wake
    (wake_up?tags=weights, reload_weights, wake_up?tags=kv_cache)."""
    t_from = ctx.lane.elapsed()
    runs = []
    for _ in range(N_LEVEL2):
        if ctx.lane.remaining() < 90:
            break
        ws = await _workers(ctx)
        name = next(n for n, w in ws.items() if w["state"] == "ready")
        model = ws[name]["model"]
        other = next(w["model"] for w in ws.values() if w["model"] != model)
        slept = await ctx.gateway().admin(f"/admin/workers/{name}/sleep?level=2", "POST")
        woke_other = await first_token(ctx, other)
        runs.append({"sleep_status": slept["status"], "other": woke_other,
                     "switch": await first_token(ctx, model)})  # fmt: skip
    return {
        "switch_ttft": _stats([r["switch"].get("ttft_s") for r in runs]),
        "failures": sum(not (r["switch"]["ok"] and r["other"]["ok"]) for r in runs),
        "runs": runs,
        "note": "load-format dummy: reload_weights re-initializes the weights on the GPU "
        "instead of reading them from disk; with real weights add their read time",
        **_memory(ctx, t_from),
    }


async def _swap_metrics(ctx: Ctx) -> dict[str, Any]:
    r = await ctx.client.get(ctx.gateway().url + "/metrics", timeout=30)
    wanted = ("gpupool_swap_", "gpupool_worker_asleep_seconds")
    lines = [ln for ln in r.text.splitlines() if ln.startswith(wanted) and "_bucket" not in ln]
    return {"gpupool_swap_metrics": lines[:40]}


def _memory(ctx: Ctx, t_from: float) -> dict[str, Any]:
    """The GPU's peak while the step ran (1 s nvidia-smi samples) against the card, and above the
    baseline before gpupool started (the rehearsal's fake nvidia-smi also counts other vLLMs)."""
    peak = ctx.sampler.peak(t_from, ctx.lane.elapsed())
    total = [g["memory_total_mib"] for g in lane_gpu.gpus()]
    base = ctx.baseline_mib or [0] * len(peak)
    return {"gpu_peak_mib": peak, "gpu_total_mib": total,
            "peak_above_baseline_mib": [p - b for p, b in zip(peak, base, strict=False)],
            "never_above_card": all(p <= t for p, t in zip(peak, total, strict=False))}  # fmt: skip


def _stats(values: list[float | None]) -> dict[str, Any]:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": _r(statistics.median(xs)), "min": xs[0], "max": xs[-1]}


def _r(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None
