"""The hybrid phase's own step: seed 000's pitfall, the first requests after a launch."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import lane_gpu
from lane_ctx import Ctx
from lane_http import chat, post, stream, text_of, words_for

BURST_TOKENS = (500, 2000, 8000, 16000, 30000, 1000, 4000, 12000)
TROUBLE = re.compile(r"out of memory|OutOfMemory|autotun|Traceback|EngineDeadError|Error", re.I)


async def first_requests(ctx: Ctx, cache: str) -> dict[str, Any]:
    """The first request after a launch (a ~20K-token prompt, streamed), then a burst of eight
    prompts of different lengths at once: what happens, how long it takes, how close the GPU
    gets to full, and what the worker logged."""
    gw, lane = ctx.gateway(), ctx.lane
    name = ctx.worker_names[0]
    per_1k = await words_for(ctx.client, ctx.direct_url(name), ctx.model, 1000)
    t0 = lane.elapsed()
    restarts0 = gw.workers[name].get("restarts", 0)
    triton_before = _triton_files(ctx)
    body = chat(ctx.model, text_of(20 * per_1k), 32)
    first = await stream(ctx.client, gw.url, body, limit_s=min(180.0, lane.remaining() / 2))
    lane.say(f"first request ({cache} cache):", first.kind(), f"TTFT {first.ttft_ms}")
    bodies = [chat(ctx.model, text_of(t * per_1k // 1000, seed=t), 64) for t in BURST_TOKENS]
    burst = await asyncio.gather(*(post(ctx.client, gw.url, b, limit_s=120) for b in bodies))
    await asyncio.sleep(2)
    total = [g["memory_total_mib"] for g in lane_gpu.gpus()]
    peak = ctx.sampler.peak(t0, lane.elapsed())
    launches = ctx.launches(name)
    text_lines = launches[-1]["lines"] if launches else []
    return {
        "cache": cache,
        "first": {
            "kind": first.kind(),
            "status": first.status,
            "ttft_ms": _r(first.ttft_ms),
            "total_ms": _r(first.total_ms),
            "error_event": first.error_event,
            "body": first.body,
        },
        "burst": [
            {
                "prompt_tokens": t,
                "status": b.get("status"),
                "ms": b.get("ms"),
                "error": b.get("error"),
            }
            for t, b in zip(BURST_TOKENS, burst, strict=True)
        ],
        "worker_state": gw.state(name),
        "restarts_during": (gw.workers[name].get("restarts") or 0) - (restarts0 or 0),
        "gpu_peak_used_mib": peak,
        "gpu_total_mib": total,
        "gpu_min_free_mib": [t - p for t, p in zip(total, peak, strict=False)] if peak else None,
        "log_trouble": [ln for ln in text_lines if TROUBLE.search(ln)][-10:],
        "triton_cache_files_before": triton_before,
        "triton_cache_files_after": _triton_files(ctx),
    }


def _triton_files(ctx: Ctx) -> int:
    root = ctx.state_dir / "cache"
    return sum(1 for p in root.glob("*/triton/**/*") if p.is_file()) if root.is_dir() else 0


def _r(x: float | None) -> float | None:
    return round(x, 1) if x is not None else None
