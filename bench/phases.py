"""The measurements, each an async function over the running targets; rounds are interleaved.

Every phase returns plain dicts (written to ``results.json`` as they are) keyed by target name.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import loadgen
from rig import CpuMeter, alone, rss_bytes
from targets import Target

PATH = "/v1/chat/completions"
PROMPT = [{"role": "user", "content": "Say something."}]


def body(model: str, stream: bool) -> bytes:
    import orjson

    return orjson.dumps({"model": model, "messages": PROMPT, "max_tokens": 64, "stream": stream})


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def rotate(targets: list[Target], k: int) -> list[Target]:
    k %= len(targets)
    return targets[k:] + targets[:k]


def _pids(targets: list[Target]) -> list[int]:
    return [t.pid for t in targets if t.pid is not None]


def _req(t: Target, model: str, stream: bool) -> bytes:
    return loadgen.request_bytes(t.port, PATH, body(model, stream), t.headers)


@dataclass
class Plan:
    """How much of everything; ``quick`` shrinks it for a smoke run."""

    rounds: int = 5
    c1_requests: int = 400
    c1_warmup: int = 100
    stream_rounds: int = 3
    streams_per_round: int = 16
    stream_concurrency: int = 8
    idle_levels: tuple[int, ...] = (1000, 5000)
    idle_open_s: float = 90.0
    step_s: float = 2.0
    step_min_requests: int = 100
    rates: tuple[int, ...] = (
        25,
        50,
        100,
        200,
        300,
        450,
        650,
        900,
        1200,
        1600,
        2000,
        2500,
        3000,
        3600,
        4300,
        5000,
        6000,
        7000,
        8500,
        10000,
        12000,
    )
    bounds_ms: tuple[float, ...] = (10.0, 50.0)

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            rounds=3,
            c1_requests=200,
            c1_warmup=50,
            stream_rounds=2,
            streams_per_round=8,
            idle_levels=(1000,),
            idle_open_s=60.0,
            step_s=1.0,
            step_min_requests=100,
        )


# ---- c=1, non-streaming ----------------------------------------------------------------------


async def latency(targets: list[Target], plan: Plan) -> dict[str, Any]:
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    round_p50: dict[str, list[float]] = {t.name: [] for t in targets}
    everyone = _pids(targets)
    for t in targets:
        with alone(t.pid, everyone):
            await loadgen.sequential(t.port, _req(t, "fast", False), plan.c1_warmup)
    for r in range(plan.rounds):
        for t in rotate(targets, r):
            with alone(t.pid, everyone):
                await loadgen.sequential(t.port, _req(t, "fast", False), 20)  # after the pause
                lat = await loadgen.sequential(t.port, _req(t, "fast", False), plan.c1_requests)
            samples[t.name] += lat
            round_p50[t.name].append(statistics.median(lat))
    out: dict[str, Any] = {
        name: {
            "p50_ms": pct(s, 50) * 1e3,
            "p99_ms": pct(s, 99) * 1e3,
            "n": len(s),
            "round_p50_ms": [x * 1e3 for x in round_p50[name]],
        }
        for name, s in samples.items()
    }
    for t in targets:
        if t.precise:  # how its requests were routed: a latency of approximate ones says nothing
            out[t.name]["kv_routed"] = t.kv_routed()
    return out


# ---- streaming ------------------------------------------------------------------------------


async def streaming(targets: list[Target], plan: Plan) -> dict[str, Any]:
    """Paced 64-chunk streams (one chunk every 20 ms upstream), several at a time.

    Gaps are between consecutive events as the client saw them (the upstream's timer jitter is
    in them); delays are each chunk's arrival minus the moment the upstream sent it.
    """
    ttft: dict[str, list[float]] = {t.name: [] for t in targets}
    gaps: dict[str, list[float]] = {t.name: [] for t in targets}
    errors = {t.name: 0 for t in targets}
    transit: dict[str, list[float]] = {t.name: [] for t in targets}
    events: dict[str, list[int]] = {t.name: [] for t in targets}
    bodies: dict[str, set[bytes]] = {t.name: set() for t in targets}
    stagger = 0.020 / plan.stream_concurrency
    everyone = _pids(targets)
    for r in range(plan.stream_rounds):
        for t in rotate(targets, r):
            req = _req(t, "paced", True)
            with alone(t.pid, everyone):
                out = await loadgen.streams(
                    t.port, req, plan.streams_per_round, plan.stream_concurrency, stagger
                )
            for a in out:
                if a is None or a.status != 200 or not a.events:
                    errors[t.name] += 1
                    continue
                ttft[t.name].append(a.events[0] - a.sent)
                gaps[t.name] += [b - x for x, b in zip(a.events, a.events[1:], strict=False)]
                transit[t.name] += a.transit
                events[t.name].append(len(a.events))
                bodies[t.name].add(loadgen.STAMP.sub(b"@", a.body))
    ref = bodies.get("direct", set())
    return {
        t.name: {
            "ttft_p50_ms": pct(ttft[t.name], 50) * 1e3,
            "ttft_p99_ms": pct(ttft[t.name], 99) * 1e3,
            "gap_p50_ms": pct(gaps[t.name], 50) * 1e3,
            "gap_p99_ms": pct(gaps[t.name], 99) * 1e3,
            "gap_max_ms": max(gaps[t.name], default=math.nan) * 1e3,
            "delay_p50_ms": pct(transit[t.name], 50) * 1e3,
            "delay_p99_ms": pct(transit[t.name], 99) * 1e3,
            "streams": len(ttft[t.name]),
            "errors": errors[t.name],
            "events_min": min(events[t.name], default=0),
            "bytes_identical_to_direct": bool(ref) and bodies[t.name] == ref,
        }
        for t in targets
    }


# ---- idle streams ---------------------------------------------------------------------------


async def idle_memory(t: Target, plan: Plan, everyone: list[int]) -> dict[str, Any]:
    """Gateway RSS with N open streams that receive a chunk every ~20 s (others paused)."""
    with alone(t.pid, everyone):
        return await _idle_memory(t, plan)


async def _idle_memory(t: Target, plan: Plan) -> dict[str, Any]:
    assert t.pid is not None
    out: dict[str, Any] = {"rss_idle_mb": rss_bytes(t.pid) / 2**20, "levels": {}}
    held = loadgen.IdleStreams(t.port, _req(t, "idle", True))
    try:
        for level in plan.idle_levels:
            want = level - held.alive
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            got = await held.open(want, plan.idle_open_s)
            opened_s = loop.time() - t0
            await asyncio.sleep(2.0)
            alive = held.alive
            rss = rss_bytes(t.pid) / 2**20
            out["levels"][str(level)] = {
                "rss_mb": rss,
                "established": alive,
                "open_s": round(opened_s, 1),
                "failed": held.failed,
                "kb_per_stream": (rss - out["rss_idle_mb"]) * 1024 / level,
            }
            print(
                f"    {t.name}: {alive}/{level} streams open, RSS {rss:.0f} MB "
                f"({opened_s:.0f}s to open; {got} new)",
                flush=True,
            )
            if alive < level * 0.99:
                break
    finally:
        held.close()
    await asyncio.sleep(3.0)
    out["rss_after_mb"] = rss_bytes(t.pid) / 2**20
    return out


# ---- the highest rate -----------------------------------------------------------------------


def _step_summary(step: loadgen.Step, meter: dict[str, float], bounds: Sequence[float]) -> dict:
    p99 = pct(step.latencies, 99) * 1e3
    achieved = step.ok / step.seconds if step.seconds else 0.0
    clean = step.errors == 0 and step.ok >= 0.99 * step.sent
    rig_cpu = meter.get("client_cpu", 0.0) + meter.get("upstream_cpu", 0.0)
    return {
        "rate": step.rate,
        "sent": step.sent,
        "ok": step.ok,
        "errors": step.errors,
        "achieved_rps": round(achieved, 1),
        "p50_ms": pct(step.latencies, 50) * 1e3,
        "p99_ms": p99,
        "lag_p99_ms": pct(step.lags, 99) * 1e3,
        "pass": {str(b): bool(clean and p99 < b) for b in bounds},
        **{k: round(v, 3) for k, v in meter.items()},
        "cpu0_foreign": round(max(0.0, meter["cpu0_busy"] - rig_cpu), 3),
        "cpu1_foreign": round(max(0.0, meter["cpu1_busy"] - meter.get("gateway_cpu", 0.0)), 3),
    }


async def _one_step(
    t: Target, plan: Plan, rate: float, rig: dict[str, int], everyone: list[int]
) -> dict[str, Any]:
    seconds = min(8.0, max(plan.step_s, plan.step_min_requests / rate))
    with alone(t.pid, everyone):
        await loadgen.sequential(t.port, _req(t, "fast", False), 20)  # after the pause
        meter = CpuMeter(rig | ({"gateway": t.pid} if t.pid else {}))
        step = await loadgen.open_loop(t.port, _req(t, "fast", False), rate, seconds)
        res = _step_summary(step, meter.read(), plan.bounds_ms)
    await asyncio.sleep(0.3)
    return res


async def max_rate(targets: list[Target], plan: Plan, rig: dict[str, int]) -> dict[str, Any]:
    """Step the offered rate up, all targets at each step (interleaved), each until it fails the
    loosest bound twice in a row (a failure is retried once: noise from the shared box)."""
    loosest = str(max(plan.bounds_ms))
    steps: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
    active = list(targets)
    everyone = _pids(targets)
    for k, rate in enumerate(plan.rates):
        for t in rotate(active, k):
            res = await _one_step(t, plan, rate, rig, everyone)
            if not res["pass"][loosest]:
                res["retried"] = True
                res = await _one_step(t, plan, rate, rig, everyone)
            steps[t.name].append(res)
            print(
                f"    {t.name:>14} {rate:>6} rps: p99 {res['p99_ms']:8.2f} ms, "
                f"errors {res['errors']}, gw {res.get('gateway_cpu', 0):.2f} core, "
                f"cpu0 {res['cpu0_busy']:.2f}",
                flush=True,
            )
            if not res["pass"][loosest]:
                active.remove(t)
        if not active:
            break
    return {name: {"steps": s, **_best(s, plan.bounds_ms)} for name, s in steps.items()}


def _best(steps: list[dict[str, Any]], bounds: Sequence[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in bounds:
        passing = [s for s in steps if s["pass"][str(b)]]
        best = max(passing, key=lambda s: s["rate"]) if passing else None
        failing = [
            s for s in steps if not s["pass"][str(b)] and (not best or s["rate"] > best["rate"])
        ]
        out[f"max_rps_{b:g}ms"] = best["rate"] if best else 0
        out[f"at_{b:g}ms"] = best
        out[f"fail_{b:g}ms"] = failing[0] if failing else None
    busy = [s for s in steps if s["ok"] and s.get("gateway_cpu")]
    if busy:
        # CPU cost per request where the gateway was busiest but still passing the loosest bound
        ok = [s for s in busy if s["pass"][str(max(bounds))]] or busy
        s = max(ok, key=lambda s: s["rate"])
        out["cpu_us_per_request"] = s["gateway_cpu"] * 1e6 / max(1.0, s["achieved_rps"])
    return out
