"""The sleep phase (issue 28): models taking turns on one GPU through gpupool.

Steps: ``launch`` (start-up in turn: one ends ready, the others asleep), ``switch_l1`` (request
sent → first token for the sleeping model, level 1: the awake one's sleep plus this one's
wake), ``cold_restart`` (the same through a restart of the worker: what a switch costs without
sleep mode), ``alternate`` (requests alternating between the models: every one a switch; no
failure allowed, GPU memory sampled against the card), ``switch_l2`` (level 2: the worker put to
sleep with ``?level=2`` wakes by reloading its weights: real-format weights only, written by
``weights`` first; with dummy weights vLLM cannot reload and the wake becomes a restart, which the
step reports from the worker's restart count), ``idle`` (the awake worker falls asleep
by itself after ``sleep.idle_s`` without requests; then a request wakes it: a wake with no sleep
before it), ``mixed`` (``LANE_MIXED_S``, 600 s: closed-loop clients of every model at once,
streamed and not; failures, first-token times, switches, how many members were ever on the GPU
together, out-of-memory lines in the worker logs). Each step also gives the GPU's peak memory
while it ran and gpupool's swap metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import time
from typing import Any

import lane_gpu
import lane_weights
from lane_ctx import Ctx
from lane_gateway import Gateway

N_SWITCHES = 5
N_ALTERNATE = 50
N_LEVEL2 = 3
MIXED_S = float(os.environ.get("LANE_MIXED_S", "600"))
MIXED_CLIENTS = 6  # per model
PROMPT = "Write one sentence about the sea."
CANARY = "The canary: list the first ten prime numbers, then name the largest ocean."
CANARY_TOKENS = 32
# the pause step: a stream long enough to outlast ``swap.pause_after_s`` and a switch both ways
PAUSE_TOKENS = int(os.environ.get("LANE_PAUSE_TOKENS", "3000"))
# states in which a member uses the GPU: never two of one group at once
ON_GPU = ("ready", "waking", "falling_asleep")
OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error", re.IGNORECASE)
# vLLM's level-2 wake in its log: the reload and its time, or why it failed
RELOAD = re.compile(r"[Rr]eload|NotImplementedError|Sleep mode freed|wake_up|collective_rpc")


async def launch(ctx: Ctx) -> dict[str, Any]:
    """Start gpupool: the group's workers start one after another; one ends awake."""
    ctx.gw = gw = Gateway(ctx.lane, ctx.config_path, ctx.port)
    gw.start(ctx.lane.work / f"gateway-{ctx.lane.phase}.log")
    names = ctx.worker_names
    settled = await gw.wait_states(names, {"ready", "asleep"}, max(10.0, ctx.lane.remaining() - 60))
    states = {n: gw.state(n) for n in names}
    t0 = gw.started_at
    awake = sum(s == "ready" for s in states.values())
    asleep = sum(s == "asleep" for s in states.values())
    return {
        "settled": settled and awake == 1 and asleep == len(states) - 1,
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
    """(the awake model, a sleeping one); with every member asleep (idle sleep), any two."""
    ws = await _workers(ctx)
    models = sorted({w["model"] for w in ws.values()})
    awake = next((w["model"] for w in ws.values() if w["state"] == "ready"), models[0])
    asleep = next(m for m in models if m != awake)
    return awake, asleep


async def _awake_worker(ctx: Ctx) -> tuple[str, str]:
    """(name, model) of the worker on the GPU; one is woken (a request) if all are asleep."""
    ws = await _workers(ctx)
    for name, w in ws.items():
        if w["state"] == "ready":
            return name, w["model"]
    name, w = sorted(ws.items())[0]
    await first_token(ctx, w["model"], max_tokens=2)
    return name, w["model"]


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


async def whole_reply(ctx: Ctx, model: str, max_tokens: int) -> dict[str, Any]:
    """A chat completion, not streamed: the whole reply (every token asked for: ignore_eos)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
    t0 = time.monotonic()
    try:
        r = await ctx.client.post(ctx.gateway().url + "/v1/chat/completions", json=body,
                                  timeout=600)  # fmt: skip
        usage = r.json().get("usage", {}) if r.status_code == 200 else {}
        tokens = usage.get("completion_tokens")
    except Exception as e:  # recorded as the request's failure
        return {"model": model, "ok": False, "error": f"{type(e).__name__}: {e}"}
    ok = r.status_code == 200 and tokens == max_tokens
    out = {"model": model, "ok": ok, "status": r.status_code, "total_s": _r(time.monotonic() - t0)}
    return out if ok else out | {"body": r.text[:300]}


async def canary(ctx: Ctx, model: str) -> dict[str, Any]:
    """The canary: one greedy completion of ``CANARY`` (temperature 0, ``CANARY_TOKENS`` tokens).
    The same weights give the same answer, so the answer after a level-2 wake (weights dropped,
    read from disk again) must equal the one before the sleep: vLLM users report garbage after
    level-2 wakes that skipped the reload, which a first token alone would not show.

    Each ask carries a ``cache_salt`` of its own, so that every canary is prefilled cold, as
    the first one and every one after a level-2 wake (which drops the KV cache) are: a canary
    whose prompt hits the prefix cache is computed by another kernel path, and on the lane's
    random weights, whose top logits nearly tie, greedy text then parts from the cold answer
    after ~30 tokens (seen on the H100, 2026-12-06: the before-sleep canaries of the second and
    third run differed from every cold one at character 117)."""
    body = {"model": model, "prompt": CANARY, "max_tokens": CANARY_TOKENS, "temperature": 0,
            "ignore_eos": True, "cache_salt": f"lane-canary-{time.monotonic_ns()}"}  # fmt: skip
    try:
        r = await ctx.client.post(ctx.gateway().url + "/v1/completions", json=body, timeout=600)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
    except Exception as e:  # recorded as the canary's failure
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    out: dict[str, Any] = {"ok": text is not None, "status": r.status_code, "text": text}
    return out if text is not None else out | {"body": r.text[:300]}


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
        "switch_ttft_by_model": {
            m: _stats([s.get("ttft_s") for s in switches if s["model"] == m])
            for m in sorted({s["model"] for s in switches})
        },
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
    name, model = await _awake_worker(ctx)
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


async def alternate(ctx: Ctx, n: int = N_ALTERNATE) -> dict[str, Any]:
    t_from = ctx.lane.elapsed()
    awake, asleep = await _models(ctx)
    replies = []
    for i in range(n):
        if ctx.lane.remaining() < 60:
            break
        replies.append(await first_token(ctx, asleep if i % 2 == 0 else awake, max_tokens=8))
    ok = [r for r in replies if r["ok"]]
    return {
        "requests": len(replies),
        "failures": len(replies) - len(ok),
        "ttft": _stats([r.get("ttft_s") for r in ok]),
        "ttft_by_model": {
            m: _stats([r.get("ttft_s") for r in ok if r["model"] == m])
            for m in sorted({r["model"] for r in ok})
        },
        "failed": [r for r in replies if not r["ok"]][:5],
        "oom_lines": _oom_lines(ctx),
        **await _swap_metrics(ctx),
        **_memory(ctx, t_from),
    }


async def weights(ctx: Ctx) -> dict[str, Any]:
    """Real-format weights (random, safetensors) in the phase's model dir, before the launch: a
    level-2 wake reloads them from disk (``lane_weights``). The rehearsal's simulator reads none."""
    if os.environ.get("LANE_REHEARSAL") == "1":
        return {"skipped": "rehearsal: the simulator reads no weights"}
    return await asyncio.to_thread(lane_weights.write, ctx.lane.work / "model")


async def switch_l2(ctx: Ctx) -> dict[str, Any]:
    """Level 2: the awake worker is put to sleep with ?level=2 (weights dropped), the other woken,
    then a request for the first: the other's sleep plus this one's level-2 wake
    (wake_up?tags=weights, reload_weights, wake_up?tags=kv_cache). Each run records the worker's
    restarts before and after: a wake that failed (vLLM cannot reload dummy weights) is a
    restart, not a level-2 switch, and its time is a restart's."""
    t_from = ctx.lane.elapsed()
    runs = []
    first: dict[str, str | None] = {}  # each model's canary answer before its first level-2 sleep
    for _ in range(N_LEVEL2):
        if ctx.lane.remaining() < 90:
            break
        name, model = await _awake_worker(ctx)
        ws = await _workers(ctx)
        other = next(w["model"] for w in ws.values() if w["model"] != model)
        restarts = ws[name]["restarts"]
        before = await canary(ctx, model)
        first.setdefault(model, before.get("text"))
        slept = await ctx.gateway().admin(f"/admin/workers/{name}/sleep?level=2", "POST")
        woke_other = await first_token(ctx, other)
        switch = await first_token(ctx, model)
        after_canary = await canary(ctx, model)
        after = (await _workers(ctx))[name]
        same = before.get("text") is not None and after_canary.get("text") == before.get("text")
        runs.append({"worker": name, "sleep_status": slept["status"], "other": woke_other,
                     "switch": switch, "restarted": after["restarts"] - restarts,
                     "last_error": after.get("last_error"), "canary_before": before,
                     "canary_after": after_canary, "canary_same": same,
                     "canary_same_as_first": after_canary.get("text") == first[model]})  # fmt: skip
    woken = [r for r in runs if not r["restarted"]]
    return {
        "switch_ttft": _stats([r["switch"].get("ttft_s") for r in woken]),
        "restarts_instead": sum(bool(r["restarted"]) for r in runs),
        "failures": sum(not (r["switch"]["ok"] and r["other"]["ok"]) for r in runs),
        "canary": {
            "runs": len(runs),
            "same_after_wake": sum(r["canary_same"] for r in runs),
            "same_as_first": sum(r["canary_same_as_first"] for r in runs),
        },
        "runs": runs,
        "reload_lines": _log_lines(ctx, RELOAD, most=60),
        **_memory(ctx, t_from),
    }


async def pause(ctx: Ctx) -> dict[str, Any]:
    """A switch's pause (``swap.pause_after_s``, vLLM's ``/sleep?mode=keep``): a long greedy
    stream on the awake model, then a request for the other model. The switch waits
    ``pause_after_s`` for the stream, pauses it (vLLM preempts it and sleeps), serves the other
    model, and the next wake of the first resumes the stream where it stopped. The stream must
    end whole: every token asked for (usage, ``finish_reason`` length), one ``[DONE]``, no error
    event, and the same text as the same request unpaused just before (greedy: a repeated or
    lost token shows as a difference; a difference only after the stall could also be the
    recomputed prefill's rounding, so the step says where the first difference is)."""
    t_from = ctx.lane.elapsed()
    name, model = await _awake_worker(ctx)
    other = next(w["model"] for w in (await _workers(ctx)).values() if w["model"] != model)
    pause_s = (ctx.config.get("swap") or {}).get("pause_after_s", 60.0)
    paused_before = await _metric_sum(ctx, "gpupool_swap_paused_requests")
    reference = await _token_stream(ctx, model, PAUSE_TOKENS)
    started = asyncio.Event()
    task = asyncio.create_task(_token_stream(ctx, model, PAUSE_TOKENS, started))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(started.wait(), 120)
    t_ask = time.monotonic()
    asked = await first_token(ctx, other)  # the switch: waits pause_after_s, pauses the stream
    asked["answered_after_s"] = _r(time.monotonic() - t_ask)
    stream = await task
    same = stream.get("text") == reference.get("text")
    diff = _first_diff(stream.get("text") or "", reference.get("text") or "")
    whole = (stream.get("ok", False) and stream["completion_tokens"] == PAUSE_TOKENS
             and stream["finish_reason"] == "length" and stream["done_lines"] == 1
             and not stream["error_events"])  # fmt: skip
    texts = {k: v.pop("text", None) for k, v in (("stream", stream), ("reference", reference))}
    paused = await _metric_sum(ctx, "gpupool_swap_paused_requests") - paused_before
    return {
        "worker": name,
        "pause_after_s": pause_s,
        "paused_requests": paused,  # 0: the stream ended before the switch paused it (no test)
        "stream": stream,
        "reference": reference,
        "other_request": asked,
        "stream_whole": whole,
        "same_text_as_unpaused": same,
        "first_difference_char": diff,
        "stall_at_char": stream.get("stall_at_char"),
        "text_heads": {k: (v or "")[:120] for k, v in texts.items()},
        "failures": int(not whole) + int(not asked["ok"]) + int(paused < 1),
        **await _swap_metrics(ctx),
        **_memory(ctx, t_from),
    }


async def _token_stream(
    ctx: Ctx, model: str, max_tokens: int, started: asyncio.Event | None = None
) -> dict[str, Any]:
    """A greedy streamed completion, every chunk timed: its text, the longest gap between chunks
    (the stall of a pause) and where in the text it fell, usage, ``[DONE]`` lines, error events."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.monotonic()
    parts: list[str] = []
    last, gap, gap_at, gap_char = t0, 0.0, None, None
    usage, finish, done, errors, chunks = None, None, 0, [], 0
    try:
        async with ctx.client.stream(
            "POST", ctx.gateway().url + "/v1/completions", json=body, timeout=900
        ) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line[6:].strip() == "[DONE]":
                    done += 1
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    errors.append(str(obj["error"])[:200])
                    continue
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or []:
                    now = time.monotonic()
                    if now - last > gap:
                        gap, gap_at, gap_char = now - last, now - t0, sum(map(len, parts))
                    last = now
                    parts.append(ch.get("text") or "")
                    chunks += 1
                    finish = ch.get("finish_reason") or finish
                    if started is not None and chunks >= 20:
                        started.set()
    except Exception as e:  # recorded as the stream's failure
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "text": "".join(parts),
                "chunks": chunks, "completion_tokens": None, "finish_reason": finish,
                "done_lines": done, "error_events": errors}  # fmt: skip
    return {
        "ok": status == 200,
        "status": status,
        "text": "".join(parts),
        "chunks": chunks,
        "completion_tokens": (usage or {}).get("completion_tokens"),
        "finish_reason": finish,
        "done_lines": done,
        "error_events": errors,
        "total_s": _r(time.monotonic() - t0),
        "longest_gap_s": _r(gap),
        "longest_gap_at_s": _r(gap_at),
        "stall_at_char": gap_char,
    }


def _first_diff(a: str, b: str) -> int | None:
    """Index of the first character where ``a`` and ``b`` differ; None when equal."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def _metric_sum(ctx: Ctx, name: str) -> float:
    r = await ctx.client.get(ctx.gateway().url + "/metrics", timeout=30)
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in r.text.splitlines()
        if ln.startswith((name + "{", name + " ", name + "_total"))
    )


async def idle(ctx: Ctx) -> dict[str, Any]:
    """``sleep.idle_s``: the awake worker, left without requests, falls asleep by itself; GPU
    memory once it has; then a request for it: a wake alone (no other worker to put to sleep)."""
    t_from = ctx.lane.elapsed()
    name, model = await _awake_worker(ctx)
    idle_s = float((ctx.worker_cfg(name).get("sleep") or {}).get("idle_s") or 0)
    if not idle_s:
        return {"error": f"{name} has no sleep.idle_s in the config"}
    await first_token(ctx, model, max_tokens=2)
    t_last = time.monotonic()
    fell = None
    while time.monotonic() - t_last < idle_s + 60:
        if (await _workers(ctx))[name]["state"] == "asleep":
            fell = time.monotonic() - t_last
            break
        await asyncio.sleep(0.5)
    used_asleep = lane_gpu.used_mib()
    wake = await first_token(ctx, model) if fell is not None else None
    return {
        "worker": name,
        "idle_s": idle_s,
        "asleep_after_s": _r(fell),
        "gpu_used_mib_all_asleep": used_asleep,
        "wake_request": wake,
        "failures": int(wake is not None and not wake["ok"]),
        **await _swap_metrics(ctx),
        **_memory(ctx, t_from),
    }


async def mixed(ctx: Ctx) -> dict[str, Any]:
    """``MIXED_S`` of load on every model of the group at once: ``MIXED_CLIENTS`` closed-loop
    clients per model, each sending streamed completions and whole chat completions (16-256
    tokens) with 0-3 s between them, so the group switches whenever the policy says. Every
    request must succeed; the members' states are sampled every second (never two on the GPU)."""
    t_from = ctx.lane.elapsed()
    ws = await _workers(ctx)
    models = sorted({w["model"] for w in ws.values()})
    switches_before = await _switch_count(ctx)
    deadline = time.monotonic() + MIXED_S
    replies: list[dict[str, Any]] = []
    on_gpu_max, samples, overlaps = 0, 0, []

    async def client(model: str, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            max_tokens = rng.randint(16, 256)
            if rng.random() < 0.6:
                reply = await first_token(ctx, model, max_tokens=max_tokens)
            else:
                reply = await whole_reply(ctx, model, max_tokens)
            replies.append(reply)
            await asyncio.sleep(rng.uniform(0, 3))

    async def watch() -> None:
        nonlocal on_gpu_max, samples
        while time.monotonic() < deadline:
            states = {n: w["state"] for n, w in (await _workers(ctx)).items()}
            on = [n for n, st in states.items() if st in ON_GPU]
            on_gpu_max, samples = max(on_gpu_max, len(on)), samples + 1
            if len(on) > 1 and len(overlaps) < 10:
                overlaps.append(states)
            await asyncio.sleep(1.0)

    clients = [client(m, 28_000 + 100 * i + j) for i, m in enumerate(models)
               for j in range(MIXED_CLIENTS)]  # fmt: skip
    await asyncio.gather(watch(), *clients)
    ok = [r for r in replies if r["ok"]]
    return {
        "seconds": MIXED_S,
        "clients_per_model": MIXED_CLIENTS,
        "requests": len(replies),
        "requests_by_model": {m: sum(r["model"] == m for r in replies) for m in models},
        "failures": len(replies) - len(ok),
        "failed": [r for r in replies if not r["ok"]][:5],
        "ttft_by_model": {
            m: _stats([r.get("ttft_s") for r in ok if r["model"] == m and "ttft_s" in r])
            for m in models
        },
        "total_by_model": {
            m: _stats([r.get("total_s") for r in ok if r["model"] == m]) for m in models
        },
        "switches": await _switch_count(ctx) - switches_before,
        "state_samples": samples,
        "most_on_gpu_at_once": on_gpu_max,
        "overlaps": overlaps,
        "oom_lines": _oom_lines(ctx),
        **await _swap_metrics(ctx),
        **_memory(ctx, t_from),
    }


async def _switch_count(ctx: Ctx) -> float:
    r = await ctx.client.get(ctx.gateway().url + "/metrics", timeout=30)
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in r.text.splitlines()
        if ln.startswith("gpupool_swap_switches_total{")
    )


def _oom_lines(ctx: Ctx) -> list[str]:
    """Out-of-memory and CUDA error lines in the workers' logs so far."""
    return _log_lines(ctx, OOM)


def _log_lines(ctx: Ctx, pattern: re.Pattern[str], most: int = 20) -> list[str]:
    out = []
    for name in ctx.worker_names:
        path = ctx.log_path(name)
        if path.exists():
            text = path.read_text(errors="replace")
            out += [f"{name}: {ln[:200]}" for ln in text.splitlines() if pattern.search(ln)]
    return out[:most]


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
