"""Precise routing across a sleep, on real vLLM (issue 34; the CPU build has no sleep mode).

The ``sleep-kv`` phase serves two models in one swap group with KV-event routing on. Its
``kv_sleep`` step asks the awake model two questions after one long shared prompt (the second
finds the prompt cached), switches to the other model (the first falls asleep: vLLM drops its KV
cache, and gpupool must drop that worker's index), then asks the first model twice more (the wake
finds nothing cached; the question after it finds the prompt again). Each answer's
``cached_tokens`` (vLLM's fact) is set beside the gateway's prediction outcome for it, and the
worker's indexed blocks are read from ``/admin/workers`` at each point.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import lane_sleep
from lane_ctx import Ctx
from lane_http import kv_series

# about 1,500 tokens: many blocks of the cache, shared by every question of the step
SYSTEM = " ".join(f"Rule {i}: answer briefly, in plain words, about the sea." for i in range(120))


async def _ask(ctx: Ctx, model: str, question: str) -> dict[str, Any]:
    """One greedy completion after ``SYSTEM`` (the lane's shapes carry no chat template)."""
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "prompt": f"{SYSTEM}\nQuestion: {question}\nAnswer:"}  # fmt: skip
    t0 = time.monotonic()
    before = await kv_series(ctx.client, ctx.gateway().url)
    try:
        r = await ctx.client.post(ctx.gateway().url + "/v1/completions", json=body, timeout=600)
    except Exception as e:  # recorded as the question's failure
        return {"model": model, "ok": False, "error": f"{type(e).__name__}: {e}"}
    after = await kv_series(ctx.client, ctx.gateway().url)
    usage = (r.json().get("usage") or {}) if r.status_code == 200 else {}
    details = usage.get("prompt_tokens_details") or {}
    out = {"model": model, "ok": r.status_code == 200, "status": r.status_code,
           "worker": r.headers.get("x-gpupool-worker"),
           "total_s": round(time.monotonic() - t0, 2), "prompt_tokens": usage.get("prompt_tokens"),
           "cached_tokens": details.get("cached_tokens"),
           "prediction": _outcome(before, after)}  # fmt: skip
    return out if r.status_code == 200 else out | {"body": r.text[:300]}


def _outcome(before: dict[str, float], after: dict[str, float]) -> str | None:
    """The outcome label whose ``gpupool_kv_predictions_total`` grew across one request."""
    for key, value in after.items():
        if key.startswith("gpupool_kv_predictions_total{") and value > before.get(key, 0.0):
            return key.split('outcome="', 1)[1].split('"', 1)[0] if 'outcome="' in key else key
    return None


async def _kv(ctx: Ctx, name: str) -> dict[str, Any]:
    r = await ctx.client.get(ctx.gateway().url + "/admin/workers", timeout=30)
    w = next((w for w in r.json()["data"] if w["name"] == name), {})
    kv = w.get("kv") or {}
    return {"state": w.get("state"), "precise": kv.get("precise"), "reason": kv.get("reason"),
            "blocks": kv.get("blocks"), "cleared": kv.get("cleared")}  # fmt: skip


async def _wait_precise(ctx: Ctx, name: str, limit_s: float = 60) -> float | None:
    """Seconds until the worker is routed precisely (its first ``/metrics`` scrape read vLLM's
    cache settings), or None past ``limit_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if (await _kv(ctx, name))["precise"]:
            return round(time.monotonic() - t0, 1)
        await asyncio.sleep(0.5)
    return None


async def kv_sleep(ctx: Ctx) -> dict[str, Any]:
    name, model = await lane_sleep._awake_worker(ctx)
    other = next(w["model"] for w in ctx.config["workers"] if w["model"] != model)
    out: dict[str, Any] = {"worker": name, "model": model}
    out["precise_after_s"] = await _wait_precise(ctx, name)
    out["first"] = await _ask(ctx, model, "How deep is the sea?")
    out["second"] = await _ask(ctx, model, "How salty is the sea?")
    out["awake"] = await _kv(ctx, name)
    out["other_model"] = await _ask(ctx, other, "Name one sea.")
    out["asleep"] = await _kv(ctx, name)
    out["wake"] = await _ask(ctx, model, "How cold is the sea?")
    out["after_wake"] = await _kv(ctx, name)
    out["again"] = await _ask(ctx, model, "How old is the sea?")
    out["kv_series"] = await kv_series(ctx.client, ctx.gateway().url)
    asks = [out[k] for k in ("first", "second", "wake", "again")]
    # the wake's request waits for the switch and is routed by it, with one worker to choose
    # (counted "approximate: no worker is known exactly"): its fact is vLLM's 0 cached tokens
    out["ok"] = (
        all(a.get("ok") for a in asks)
        and out["asleep"]["state"] == "asleep"
        and not out["asleep"]["blocks"]
        and out["wake"].get("cached_tokens") == 0
        and (out["again"].get("cached_tokens") or 0) > 0
        and all(out[k].get("prediction") == "exact" for k in ("first", "second", "again"))
    )
    return out
