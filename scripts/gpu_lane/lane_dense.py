"""The dense phase's own steps: routing, throughput, TTFT, faults, prefix affinity, TP-2."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import lane_gpu
from lane_ctx import Ctx
from lane_http import (
    Background,
    chat,
    count_tokens,
    kv_series,
    load_phase,
    metrics,
    migrations,
    post,
    prefix_counts,
    stream,
    text_of,
    words_for,
)
from lane_util import median, quantile


async def routing(ctx: Ctx) -> dict[str, Any]:
    """Short → the smallest window; long → the window that holds it; too long → vLLM's 400."""
    names = ctx.by_window()
    small, big = names[0], names[-1]
    w_small, w_big = ctx.window(small), ctx.window(big)
    gw, probe = ctx.gateway().url, ctx.direct_url(big)
    per_1k = await words_for(ctx.client, probe, ctx.model, 1000)
    cases = {
        "short": (100, small),
        "long": (min(int(w_small * 1.7), (w_small + w_big) // 2), big),
        "too_long": (int(w_big * 1.3), None),
    }
    out: dict[str, Any] = {"windows": {small: w_small, big: w_big}}
    for label, (tokens, expect) in cases.items():
        content = text_of(max(1, tokens * per_1k // 1000))
        counted = await _count(ctx, probe, content) if tokens < w_big else None
        r = await post(ctx.client, gw, chat(ctx.model, content, 8))
        ok = r.get("worker") == expect if expect else r.get("status") == 400
        out[label] = {
            "target_tokens": tokens,
            "prompt_tokens": counted,
            "expect": expect or "400",
            **r,
            "ok": ok,
        }
        ctx.lane.say(f"routing {label}: {tokens} tokens ->", r.get("status"), r.get("worker"))
    out["all_ok"] = all(out[k]["ok"] for k in cases)
    return out


async def _count(ctx: Ctx, url: str, content: str) -> int | None:
    try:
        return await count_tokens(ctx.client, url, ctx.model, content)
    except Exception:  # a count is a nicety; routing is the point
        return None


async def throughput(ctx: Ctx, rounds: int = 4, n: int = 512, conc: int = 256) -> dict[str, Any]:
    """Tokens/s through gpupool against the same workers reached directly (round-robin)."""
    direct = [ctx.direct_url(w) for w in ctx.by_window()]
    gw = [ctx.gateway().url]
    bodies = [chat(ctx.model, text_of(200), 256) for _ in range(n)]
    await load_phase(ctx.client, direct, bodies[:64], 64)
    await load_phase(ctx.client, gw, bodies[:64], 64)
    out: dict[str, Any] = {"requests": n, "concurrency": conc, "max_tokens": 256, "rounds": []}
    for i in range(rounds):
        if i >= 2 and ctx.lane.remaining() < 200:
            break
        order = [("direct", direct), ("gpupool", gw)]
        res = {}
        for name, urls in order if i % 2 == 0 else order[::-1]:
            res[name] = await load_phase(ctx.client, urls, bodies, conc)
        res["ratio"] = round(res["gpupool"]["tok_s"] / max(res["direct"]["tok_s"], 1e-9), 4)
        out["rounds"].append(res)
        if ctx.kv_routing():  # precise routing on: what the index knew, after each round
            out.setdefault("kv", []).append(await kv_series(ctx.client, ctx.gateway().url))
        ctx.lane.say(
            f"throughput round {i + 1}: direct {res['direct']['tok_s']:.0f} tok/s, "
            f"gpupool {res['gpupool']['tok_s']:.0f} tok/s, ratio {res['ratio']}"
        )
    d = sum(r["direct"]["tok_s"] for r in out["rounds"])
    g = sum(r["gpupool"]["tok_s"] for r in out["rounds"])
    out["ratio"] = round(g / d, 4) if d else None
    out["ratio_median"] = median([r["ratio"] for r in out["rounds"]])
    return out


async def ttft(ctx: Ctx, n: int = 20) -> dict[str, Any]:
    """TTFT at idle, streamed, interleaved: direct to the worker gpupool picks vs through it."""
    gw = ctx.gateway().url
    body = chat(ctx.model, text_of(200), 16, stream=True)
    first = await stream(ctx.client, gw, body)
    target = first.worker or ctx.by_window()[0]
    direct = ctx.direct_url(target)
    d: list[float] = []
    g: list[float] = []
    for _ in range(n):
        for url, into in ((direct, d), (gw, g)):
            o = await stream(ctx.client, url, body)
            if o.ttft_ms is not None and o.status == 200:
                into.append(o.ttft_ms)
    pd, pg = median(d), median(g)
    return {
        "worker": target,
        "n": n,
        "direct_p50_ms": _r(pd),
        "gpupool_p50_ms": _r(pg),
        "p50_diff_ms": _r(pg - pd) if pd is not None and pg is not None else None,
        "direct_p90_ms": _r(quantile(d, 0.9)),
        "gpupool_p90_ms": _r(quantile(g, 0.9)),
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def _r(x: float | None) -> float | None:
    return round(x, 2) if x is not None else None


async def kill(ctx: Ctx) -> dict[str, Any]:
    """``kill -9`` of a worker's vLLM under streaming load: what the clients saw (errors, with
    request migration none should be), the migrations the gateway counted, restart, GPU
    memory."""
    gw, lane = ctx.gateway(), ctx.lane
    body = chat(ctx.model, text_of(200), 1000, stream=True)
    bg = Background(ctx.client, gw.url, body, n=96, t0=lane.t0).start()
    try:
        return await _kill_under_load(ctx, bg)
    finally:
        await bg.stop()


async def _kill_under_load(ctx: Ctx, bg: Background) -> dict[str, Any]:
    gw, lane = ctx.gateway(), ctx.lane
    await asyncio.sleep(5)
    inflight = {n: gw.workers[n].get("inflight", 0) for n in ctx.by_window()}
    target = max(inflight, key=lambda n: inflight[n])
    guard = gw.workers[target]["pid"]
    victims = lane_gpu.children_of(guard)
    procs_before = lane_gpu.apps_by_worker(gw.guards())
    used_before = lane_gpu.used_mib()
    moved_before = await migrations(ctx.client, gw.url)
    os.kill(victims[0], signal.SIGKILL)
    t_kill = lane.elapsed()
    lane.say(f"kill -9 {victims[0]} (vLLM of {target}, guard {guard})")
    await gw.wait_states([target], {"starting", "warming", "failed", "stopped"}, 30)
    t_down = lane.elapsed()
    ok = await gw.wait_states([target], {"ready"}, max(30.0, min(300.0, lane.remaining() - 100)))
    t_ready = lane.elapsed()
    await asyncio.sleep(3)
    summary = await bg.stop()
    moved = _delta(moved_before, await migrations(ctx.client, gw.url))
    near = [o for t, o in bg.outcomes if t_kill <= t <= t_kill + 15 and o.kind() != "complete"]
    errors = [o for t, o in bg.outcomes if t >= t_kill and o.kind() != "complete"]
    dip = ctx.sampler.between(t_kill, t_ready)
    # streams running at the kill (ended after it, began before it) on the killed worker: with
    # migration (routing.migrations) they end complete on another; their longest gap between two
    # chunks is the client's wait for the next token
    running = [o for t, o in bg.outcomes
               if t >= t_kill and t - o.total_ms / 1000 <= t_kill and o.kind() == "complete"
               and o.max_gap_ms > 0 and o.worker == target]  # fmt: skip
    gaps = sorted(o.max_gap_ms for o in running)
    return {
        "worker": target,
        "running_at_kill_complete": len(running),
        "next_token_gap_ms": _gap_stats(gaps),
        "inflight_at_kill": inflight,
        "killed_pid": victims[0],
        "guard_pid": guard,
        "recovered": ok,
        "noticed_after_s": round(t_down - t_kill, 1),
        "ready_again_after_s": round(t_ready - t_kill, 1) if ok else None,
        "restarts": gw.workers[target].get("restarts"),
        "last_error": gw.workers[target].get("last_error"),
        "client_outcomes": summary,
        "client_errors": len(errors),  # streams ended after the kill without a clean [DONE]
        "migrations": moved,  # gpupool_migrations_total by cause/outcome, during the step
        "migrated_streams": sum(v for k, v in moved.items() if k.endswith("/continued")),
        "error_event_example": next((o.error_event for o in near if o.error_event), None),
        "other_failures_example": next(
            (o.kind() + " " + (o.body or o.exception or "") for o in near if not o.error_event),
            None,
        ),
        "gpu_used_mib_before": used_before,
        "gpu_used_mib_min_while_down": [min(s[1][i] for s in dip) for i in range(len(used_before))]
        if dip
        else None,
        "gpu_used_mib_after": lane_gpu.used_mib(),
        "gpu_processes_before": procs_before,
        "gpu_processes_after": lane_gpu.apps_by_worker(gw.guards()),
        "relaunch": ctx.launches(target)[-1]["figures"] if ctx.launches(target) else None,
    }


def _gap_stats(gaps: list[float]) -> dict[str, Any]:
    if not gaps:
        return {"n": 0}
    return {"n": len(gaps), "p50": round(gaps[len(gaps) // 2], 1), "max": round(gaps[-1], 1)}


async def drain(ctx: Ctx) -> dict[str, Any]:
    """Drain the long-window worker under load (in-flight work finishes), then restart it."""
    gw, lane = ctx.gateway(), ctx.lane
    names = ctx.by_window()
    small, big = names[0], names[-1]
    per_1k = await words_for(ctx.client, ctx.direct_url(big), ctx.model, 1000)
    long_text = text_of(int(ctx.window(small) * 1.5) * per_1k // 1000)
    body = chat(ctx.model, long_text, 128, stream=True)
    bg = Background(ctx.client, gw.url, body, n=4, t0=lane.t0).start()
    try:
        return await _drain_under_load(ctx, big, long_text, bg)
    finally:
        await bg.stop()


async def _drain_under_load(ctx: Ctx, big: str, long_text: str, bg: Background) -> dict[str, Any]:
    gw, lane = ctx.gateway(), ctx.lane
    await asyncio.sleep(4)
    used_before, t0 = lane_gpu.used_mib(), lane.elapsed()
    r = await gw.admin(f"/admin/workers/{big}/drain?timeout_s=120", "POST", limit_s=180)
    t_drained = lane.elapsed()
    during_long = await post(ctx.client, gw.url, chat(ctx.model, long_text, 8))
    during_short = await post(ctx.client, gw.url, chat(ctx.model, text_of(50), 8))
    await bg.stop()
    before = [o for t, o in bg.outcomes if t <= t_drained]
    await asyncio.sleep(3)
    used_drained = lane_gpu.used_mib()
    t1 = lane.elapsed()
    r2 = await gw.admin(f"/admin/workers/{big}/restart", "POST", limit_s=60)
    ok = await gw.wait_states([big], {"ready"}, max(30.0, min(300.0, lane.remaining() - 60)))
    t_ready = lane.elapsed()
    after = await post(ctx.client, gw.url, chat(ctx.model, long_text, 8)) if ok else None
    return {
        "worker": big,
        "drain_status": r["status"],
        "state_after_drain": (r["body"] or {}).get("state"),
        "drain_s": round(t_drained - t0, 1),
        "in_flight_during_drain": _kinds(before),
        "long_request_while_drained": during_long,
        "short_request_while_drained": during_short,
        "gpu_used_mib_before": used_before,
        "gpu_used_mib_drained": used_drained,
        "restart_status": r2["status"],
        "ready_after_restart_s": round(t_ready - t1, 1) if ok else None,
        "long_request_after_restart": after,
        "gpu_used_mib_after": lane_gpu.used_mib(),
        "relaunch": ctx.launches(big)[-1]["figures"] if ctx.launches(big) else None,
    }


def _kinds(outcomes: list[Any]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind()] = kinds.get(o.kind(), 0) + 1
    return kinds


async def affinity(ctx: Ctx, conversations: int = 16, turns: int = 4) -> dict[str, Any]:
    """A multi-turn workload through gpupool (prefix affinity) and round-robin over the same
    workers: follow-up TTFT and vLLM's prefix-cache hit rate, interleaved."""
    workers = ctx.by_window()
    direct = [ctx.direct_url(w) for w in workers]
    out: dict[str, Any] = {"conversations": conversations, "turns": turns, "rounds": []}
    for r in range(2):
        if r and ctx.lane.remaining() < 90:
            break
        res = {}
        for mode in ("gpupool", "round-robin"):
            seed = 1000 * (r * 2 + (mode == "gpupool")) + 7
            res[mode] = await _conversations(ctx, mode, direct, seed, conversations, turns)
        out["rounds"].append(res)
        if ctx.kv_routing():  # precise routing on: what the index knew, after each round
            out.setdefault("kv", []).append(await kv_series(ctx.client, ctx.gateway().url))
        ctx.lane.say(
            f"affinity round {r + 1}:",
            {m: (v["hit_rate"], v["followup_ttft_p50_ms"]) for m, v in res.items()},
        )
    if ctx.kv_routing():
        r = await ctx.client.get(ctx.gateway().url + "/admin/workers", timeout=30)
        body = r.json() if r.status_code == 200 else {}
        rows = body.get("data", []) if isinstance(body, dict) else []
        out["kv_workers"] = {w.get("name", "?"): w.get("kv") for w in rows} or {
            "status": r.status_code
        }
    for mode in ("gpupool", "round-robin"):
        rows = [x[mode] for x in out["rounds"]]
        out[mode] = {
            "hit_rate": _r(median([x["hit_rate"] for x in rows if x["hit_rate"] is not None])),
            "followup_ttft_p50_ms": _r(
                median(
                    [
                        x["followup_ttft_p50_ms"]
                        for x in rows
                        if x["followup_ttft_p50_ms"] is not None
                    ]
                )
            ),
        }
    return out


async def _conversations(
    ctx: Ctx, mode: str, direct: list[str], seed: int, n: int, turns: int
) -> dict[str, Any]:
    gw = ctx.gateway().url
    before = [prefix_counts(await metrics(ctx.client, u)) for u in direct]
    firsts: list[float] = []
    follow: list[float] = []
    placed: dict[str, int] = {}

    async def one(c: int) -> None:
        messages = [{"role": "user", "content": text_of(450, seed + c)}]  # ~1.5K tokens
        for k in range(turns):
            url = gw if mode == "gpupool" else direct[(c + k) % len(direct)]
            body = {**chat(ctx.model, "", 24, stream=True), "messages": messages}
            o = await stream(ctx.client, url, body)
            if o.ttft_ms is not None:
                (follow if k else firsts).append(o.ttft_ms)
            placed[str(o.worker or url)] = placed.get(str(o.worker or url), 0) + 1
            messages = [
                *messages,
                {"role": "assistant", "content": text_of(20, seed + c + k)},
                {"role": "user", "content": text_of(40, seed + 50 + c + k)},
            ]

    await asyncio.gather(*(one(c) for c in range(n)))
    after = [prefix_counts(await metrics(ctx.client, u)) for u in direct]
    q = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    h = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "hit_rate": round(h / q, 4) if q else None,
        "queried_tokens": q,
        "hit_tokens": h,
        "first_ttft_p50_ms": _r(median(firsts)),
        "followup_ttft_p50_ms": _r(median(follow)),
        "followup_ttft_p90_ms": _r(quantile(follow, 0.9)),
        "placed": placed,
    }


async def tp2(ctx: Ctx) -> dict[str, Any]:
    """A tensor-parallel worker (several GPUs): served, and its processes on every GPU."""
    gw = ctx.gateway()
    out: dict[str, Any] = {}
    for w in ctx.config["workers"]:
        tp = (w.get("launch") or {}).get("args", {}).get("tensor-parallel-size", 1)
        if int(tp) < 2:
            continue
        r = await post(ctx.client, gw.url, chat(w["model"], text_of(100), 16))
        procs = lane_gpu.apps_by_worker(gw.guards()).get(w["name"], [])
        out[w["name"]] = {
            "tensor_parallel_size": tp,
            "request": r,
            "gpu_processes": procs,
            "gpus_used": sorted({p["gpu"] for p in procs}),
        }
    return out or {"skipped": "no worker with tensor-parallel-size >= 2 in this config"}
