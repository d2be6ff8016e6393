"""Steady-state throughput: the same closed-loop load direct and through gpupool, measured by
vLLM's own generated-token counters over a fixed window (no wave or tail effects)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from lane_ctx import Ctx
from lane_http import chat, metrics, post, text_of, words_for
from lane_util import median

GEN = ("vllm:generation_tokens_total", "vllm:generation_tokens")


def _generated(m: dict[str, float]) -> float:
    return next((m[k] for k in GEN if k in m), 0.0)


async def _window(
    ctx: Ctx, route: Callable[[int], str], prompt: str, clients: int, warm_s: float, window_s: float
) -> dict[str, Any]:
    """``clients`` loops sending requests (max_tokens 64-448, seeded per client, the same in every
    mode); tokens/s = the workers' generated-token counters over ``window_s`` after ``warm_s``."""
    direct = [ctx.direct_url(w) for w in ctx.by_window()]
    placed: dict[str, int] = {}

    async def client(k: int) -> None:
        rng = random.Random(k)
        while True:
            r = await post(ctx.client, route(k), chat(ctx.model, prompt, rng.randint(64, 448)))
            placed[str(r.get("worker"))] = placed.get(str(r.get("worker")), 0) + 1

    tasks = [asyncio.create_task(client(k)) for k in range(clients)]
    samples: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(warm_s)
        m0, t0 = sum([_generated(await metrics(ctx.client, u)) for u in direct]), time.monotonic()
        sampler = asyncio.create_task(_sample(ctx, samples))
        await asyncio.sleep(window_s)
        sampler.cancel()
        m1, t1 = sum([_generated(await metrics(ctx.client, u)) for u in direct]), time.monotonic()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(2)  # vLLM aborts the cancelled requests
    ctx.lane.say(f"window: {m1 - m0:.0f} tokens in {t1 - t0:.1f} s")
    return {"tok_s": round((m1 - m0) / (t1 - t0), 1), "tokens": m1 - m0, "placed": placed,
            "per_worker": _per_worker(samples)}  # fmt: skip


async def _sample(ctx: Ctx, samples: list[dict[str, Any]]) -> None:
    """Once a second until cancelled: per worker the gateway's slots held (its own requests in
    flight) and vLLM's running and waiting counts, to say where throughput went."""
    names = ctx.by_window()
    while True:
        row: dict[str, Any] = {}
        try:
            r = await ctx.client.get(ctx.gateway().url + "/admin/workers", timeout=5)
            held = {w["name"]: w["inflight"] for w in r.json()["data"]}
        except Exception:  # a figure is a nicety; the window's tokens are the point
            held = {}
        for w in names:
            m = await metrics(ctx.client, ctx.direct_url(w))
            row[w] = (held.get(w), m.get("vllm:num_requests_running"),
                      m.get("vllm:num_requests_waiting"))  # fmt: skip
        samples.append(row)
        await asyncio.sleep(1)


def _per_worker(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Each worker's mean gateway slots held, vLLM running and waiting over the samples."""
    out: dict[str, Any] = {}
    for w in {name for row in samples for name in row}:
        rows = [row[w] for row in samples if w in row]

        def mean(i: int, rows: list[Any] = rows) -> float | None:
            vals = [r[i] for r in rows if r[i] is not None]
            return round(sum(vals) / len(vals), 1) if vals else None

        out[w] = {"held": mean(0), "running": mean(1), "waiting": mean(2), "samples": len(rows)}
    return out


async def steady(ctx: Ctx, rounds: int = 4, window_s: float = 15) -> dict[str, Any]:
    """Both workers: 256 clients (their total max-num-seqs), round-robin by client vs gpupool."""
    direct = [ctx.direct_url(w) for w in ctx.by_window()]
    gw = ctx.gateway().url
    prompt = text_of(200)
    modes: dict[str, Callable[[int], str]] = {
        "direct": lambda k: direct[k % len(direct)],
        "gpupool": lambda k: gw,
    }
    return await _rounds(ctx, modes, prompt, 256, rounds, window_s, reserve_s=100)


async def single(ctx: Ctx, rounds: int = 2, window_s: float = 15) -> dict[str, Any]:
    """One worker only: prompts longer than the small window, so gpupool must pick the big one;
    the same clients direct to it. Isolates the proxy from placement."""
    names = ctx.by_window()
    small, big = names[0], names[-1]
    per_1k = await words_for(ctx.client, ctx.direct_url(big), ctx.model, 1000)
    prompt = text_of(int(ctx.window(small) * 1.25) * per_1k // 1000)
    direct, gw = ctx.direct_url(big), ctx.gateway().url
    modes: dict[str, Callable[[int], str]] = {"direct": lambda k: direct, "gpupool": lambda k: gw}
    out = await _rounds(ctx, modes, prompt, 128, rounds, window_s)
    return {"worker": big, **out}


async def _rounds(
    ctx: Ctx,
    modes: dict[str, Callable[[int], str]],
    prompt: str,
    clients: int,
    rounds: int,
    window_s: float,
    reserve_s: float = 0,
) -> dict[str, Any]:
    out: dict[str, Any] = {"clients": clients, "window_s": window_s, "rounds": []}
    order = list(modes)
    for i in range(rounds):
        if i and ctx.lane.remaining() - 40 < 2 * (window_s + 12) + reserve_s:
            break
        res: dict[str, Any] = {}
        for name in order if i % 2 == 0 else order[::-1]:
            res[name] = await _window(ctx, modes[name], prompt, clients, 4, window_s)
        res["ratio"] = round(res["gpupool"]["tok_s"] / max(res["direct"]["tok_s"], 1e-9), 4)
        out["rounds"].append(res)
        ctx.lane.say(
            f"steady round {i + 1} ({clients} clients): direct {res['direct']['tok_s']:.0f}, "
            f"gpupool {res['gpupool']['tok_s']:.0f} tok/s, ratio {res['ratio']}"
        )
    d = sum(r["direct"]["tok_s"] for r in out["rounds"])
    g = sum(r["gpupool"]["tok_s"] for r in out["rounds"])
    out["ratio"] = round(g / d, 4) if d else None
    out["ratio_median"] = median([r["ratio"] for r in out["rounds"]])
    return out
