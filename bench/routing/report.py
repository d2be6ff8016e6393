"""The routing bench's results: ``results.json``, ``results.md`` (a table per workload, the
spread between rounds, the issue's targets) and one PNG per workload."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

Runs = list[dict[str, Any]]


def pct(xs: list[float], q: float) -> float:
    s = sorted(x for x in xs if x == x)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def ms(x: float) -> str:
    if x == math.inf:
        return "never"
    return "n/a" if x != x else f"{x * 1e3:,.0f}"


def pooled(runs: Runs, key: str) -> list[float]:
    return [x for r in runs for x in r[key]]


def spread(runs: Runs, key: str, q: float = 50) -> str:
    """Per-round percentile, min-max, in ms."""
    vals = [pct(r[key], q) for r in runs]
    vals = [v for v in vals if v == v]
    if len(vals) < 2:
        return "n/a"
    return f"{min(vals) * 1e3:,.0f}-{max(vals) * 1e3:,.0f}"


def brief(wl: str, out: dict[str, Any]) -> str:
    if wl == "multi_turn":
        return (f"TTFT p50 {ms(pct(out['ttft'], 50))} p99 {ms(pct(out['ttft'], 99))} ms, "
                f"hit {out['hit_rate']:.0%}, errors {out['errors']}")  # fmt: skip
    if wl == "mixed":
        return (
            f"long TTFT p50 {ms(pct(out['long_ttft'], 50))} ms, errors long "
            f"{out['long_errors']} short {out['short_errors']}, {out['ok_per_s']:.2f} ok/s"
        )
    if wl == "tenants":
        return (f"TTFT p50 {ms(pct(out['ttft'], 50))} p90 {ms(pct(out['ttft'], 90))} ms, "
                f"hit {out['hit_rate']:.0%}, completed {out['completed_in_window']}/"
                f"{out['sent']} in the window ({out['completed']} in all), served "
                + "/".join(f"{v:.0f}" for v in out["served"].values()))  # fmt: skip
    if wl == "flood":
        return (
            f"interactive p99 idle {ms(pct(out['idle'], 99))} flood "
            f"{ms(pct(out['flood'], 99))} ms, batch {out['batch_wall']:.1f} s"
        )
    return (
        f"p50 {ms(pct(out['latency'], 50))} p99 {ms(pct(out['latency'], 99))} ms, "
        f"slow share {slow_share(out):.0%}"
    )


def slow_share(out: dict[str, Any]) -> float:
    slow = out.get("slow_worker", "short")
    served = dict(out["served"])
    # the hogs' own completions; the counters and the hog count are read a moment apart
    served[slow] = max(0.0, served.get(slow, 0) - out.get("hog_done", 0))
    total = sum(served.values())
    return served.get(slow, 0) / total if total else float("nan")


# ---- tables -----------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def multi_turn_rows(runs: dict[str, Runs]) -> list[list[str]]:
    rows = []
    for name, rs in runs.items():
        hits = [r["hit_rate"] for r in rs]
        rows.append([name, ms(pct(pooled(rs, "ttft"), 50)), ms(pct(pooled(rs, "ttft"), 99)),
                     spread(rs, "ttft"), ms(pct(pooled(rs, "ttft_later_turns"), 50)),
                     f"{statistics.mean(hits):.0%} ({min(hits):.0%}-{max(hits):.0%})",
                     str(sum(r["errors"] for r in rs))])  # fmt: skip
    return rows


def shorts_on_long(rs: Runs) -> str:
    """The share of the short prompts served that the long-window worker served: is the long
    worker kept free for the prompts only it holds? (Its successes less the long ones.)"""
    on_long = shorts = 0.0
    for r in rs:
        served = r.get("served", {}).get(r.get("long_worker", "long"))
        if served is None:
            return "n/a"
        on_long += served - len(r["long_ttft"])
        shorts += len(r["short_ttft"])
    return f"{on_long / shorts:.0%}" if shorts else "n/a"


def mixed_rows(runs: dict[str, Runs]) -> list[list[str]]:
    rows = []
    for name, rs in runs.items():
        rate = [r["ok_per_s"] for r in rs]
        sample = next((r["long_error_sample"] for r in rs if r["long_error_sample"]), "")
        rows.append([name, str(sum(r["long_errors"] for r in rs)),
                     str(sum(r["short_errors"] for r in rs)),
                     ms(pct(pooled(rs, "long_ttft"), 50)), ms(pct(pooled(rs, "long_ttft"), 99)),
                     spread(rs, "long_ttft"), shorts_on_long(rs),
                     ms(pct(pooled(rs, "short_ttft"), 50)),
                     f"{statistics.mean(rate):.2f} ({min(rate):.2f}-{max(rate):.2f})",
                     sample[:60].replace("|", "/")])  # fmt: skip
    return rows


def flood_rows(runs: dict[str, Runs]) -> list[list[str]]:
    rows = []
    for name, rs in runs.items():
        idle, busy = pooled(rs, "idle"), pooled(rs, "flood")
        ratio = pct(busy, 99) / pct(idle, 99)
        rows.append([name, ms(pct(idle, 50)), ms(pct(idle, 99)), ms(pct(busy, 50)),
                     ms(pct(busy, 99)), spread(rs, "flood", 99), f"{ratio:.2f}x",
                     f"{statistics.mean(r['batch_wall'] for r in rs):.1f}",
                     str(sum(r["errors"] for r in rs))])  # fmt: skip
    return rows


def uneven_rows(runs: dict[str, Runs]) -> list[list[str]]:
    rows = []
    for name, rs in runs.items():
        share = [slow_share(r) for r in rs]
        lat = pooled(rs, "latency")
        ttft99 = ms(pct(pooled(rs, "ttft"), 99))
        errors = str(sum(r["errors"] for r in rs))
        rows.append([name, ms(pct(lat, 50)), ms(pct(lat, 99)), spread(rs, "latency", 99), ttft99,
                     f"{statistics.mean(share):.0%}", errors])  # fmt: skip
    return rows


def tenants_rows(runs: dict[str, Runs]) -> list[list[str]]:
    rows = []
    for name, rs in runs.items():
        hits = [r["hit_rate"] for r in rs]
        served: dict[str, float] = {}
        for r in rs:
            for w, v in r["served"].items():
                served[w] = served.get(w, 0.0) + v
        rows.append([name, ms(pct(pooled(rs, "ttft"), 50)), ms(pct(pooled(rs, "ttft"), 90)),
                     spread(rs, "ttft", 90),
                     f"{statistics.mean(hits):.0%} ({min(hits):.0%}-{max(hits):.0%})",
                     f"{sum(r['completed_in_window'] for r in rs)} / "
                     f"{sum(r['sent'] for r in rs)}",
                     str(sum(r["completed"] for r in rs)),
                     str(sum(r["errors"] + r["cancelled"] for r in rs)),
                     " / ".join(f"{v:.0f}" for v in served.values())])  # fmt: skip
    return rows


TABLES = {
    "multi_turn": (
        "1. Multi-turn conversations",
        ["router", "TTFT p50 ms", "TTFT p99 ms", "p50 per round", "later turns p50 ms",
         "prefix-cache hit rate (rounds)", "errors"],
        multi_turn_rows,
    ),
    "mixed": (
        "2. Mixed context lengths (long- and short-window worker)",
        ["router", "long errors", "short errors", "long TTFT p50 ms", "long TTFT p99 ms",
         "long p50 per round", "short prompts on the long worker", "short TTFT p50 ms",
         "ok req/s (rounds)", "a long request's error"],
        mixed_rows,
    ),
    "flood": (
        "3. Batch flood with an interactive tenant",
        ["router", "idle p50 ms", "idle p99 ms", "flood p50 ms", "flood p99 ms",
         "flood p99 per round", "p99 flood/idle", "batch s", "errors"],
        flood_rows,
    ),
    "uneven": (
        "4. One slowed worker",
        ["router", "latency p50 ms", "latency p99 ms", "p99 per round", "TTFT p99 ms",
         "share to the slowed worker", "errors"],
        uneven_rows,
    ),
    "tenants": (
        "5. Many tenants with long shared prefixes (llm-d's shape)",
        ["router", "TTFT p50 ms", "TTFT p90 ms", "p90 per round", "vLLM prefix hit rate (rounds)",
         "completed in the window / sent", "completed in all", "failed or cancelled",
         "served per worker"],
        tenants_rows,
    ),
}  # fmt: skip


# ---- targets ----------------------------------------------------------------------------------


def _ok(cond: bool) -> str:
    return "**met**" if cond else "**missed**"


def targets(res: dict[str, Any]) -> list[str]:
    runs, out = res["runs"], []
    gp = "gpupool"
    if gp in runs.get("multi_turn", {}):
        rs = runs["multi_turn"]
        p50 = {n: pct(pooled(r, "ttft"), 50) for n, r in rs.items()}
        hit = {n: statistics.mean(x["hit_rate"] for x in r) for n, r in rs.items()}
        peers = [n for n in rs if not n.startswith(gp)]  # gpupool@REV: our own
        rr = next((n for n in peers if n.endswith("round_robin")), None)
        best = min(peers, key=lambda n: p50[n]) if peers else None
        if rr and best:
            lo, hi = ratio_interval(rs[gp], rs[best], "ttft")
            out.append(f"- Workload 1: TTFT p50 {ms(p50[gp])} ms = {p50[gp] / p50[rr]:.2f}x "
                       f"round-robin's (target ≤ 0.70x: {_ok(p50[gp] <= 0.7 * p50[rr])}); best "
                       f"peer {best} {ms(p50[best])} ms ({_ok(p50[gp] <= p50[best])}; "
                       f"{p50[gp] / p50[best]:.2f}x, 90% interval {lo:.2f}x-{hi:.2f}x: "
                       f"{_distinct(lo, hi)}); hit rate "
                       f"{hit[gp]:.0%} vs best peer {max(hit[n] for n in peers):.0%} "
                       f"({_ok(hit[gp] >= max(hit[n] for n in peers))})")  # fmt: skip
    if gp in runs.get("mixed", {}):
        rs = runs["mixed"]
        errs = sum(r["long_errors"] + r["short_errors"] for r in rs[gp])
        p50 = {n: pct(pooled(r, "long_ttft"), 50) for n, r in rs.items()}
        peers = [n for n in rs if not n.startswith(gp)]  # gpupool@REV: our own
        beats = bool(peers) and all(p50[n] != p50[n] or p50[gp] < p50[n] for n in peers)
        idle = res.get("long_prefill_s")
        floor = f" ({p50[gp] / idle:.2f}x a prefill on the idle long worker)" if idle else ""
        out.append(f"- Workload 2: {errs} errors through gpupool ({_ok(errs == 0)}); long TTFT "
                   f"p50 {ms(p50[gp])} ms{floor}, better than every peer's that served any: "
                   f"{_ok(beats)}")  # fmt: skip
        out += paired_long(rs, peers)
        out += all_long(rs, peers)
    if gp in runs.get("flood", {}):
        rs = runs["flood"][gp]
        ratio = pct(pooled(rs, "flood"), 99) / pct(pooled(rs, "idle"), 99)
        out.append(
            f"- Workload 3: interactive p99 under the flood {ratio:.2f}x its idle p99 "
            f"(target ≤ 2x: {_ok(ratio <= 2)})"
        )
    if gp in runs.get("uneven", {}):
        rs = runs["uneven"]
        p99 = {n: pct(pooled(r, "latency"), 99) for n, r in rs.items()}
        peers = [n for n in rs if not n.startswith(gp)]  # gpupool@REV: our own
        if peers:
            best = min(peers, key=lambda n: p99[n])
            out.append(
                f"- Workload 4: p99 {ms(p99[gp])} ms vs best peer {best} {ms(p99[best])} "
                f"ms ({_ok(p99[gp] <= p99[best])})"
            )
    out += tenants_target(runs.get("tenants", {}))
    return out


def tenants_target(rs: dict[str, Runs]) -> list[str]:
    """Issue 34: precise routing has the lowest TTFT p90 and the highest hit rate."""
    gp = next((n for n in rs if n == "gpupool:precise"), None)
    if gp is None or len(rs) < 2:
        return []
    p90 = {n: pct(pooled(r, "ttft"), 90) for n, r in rs.items()}
    hit = {n: statistics.mean(x["hit_rate"] for x in r) for n, r in rs.items()}
    others = [n for n in rs if ":precise" not in n]  # precise at other leads or revisions
    if not others:
        return []
    best = min(others, key=lambda n: p90[n])
    lo, hi = ratio_interval(rs[gp], rs[best], "ttft", 90)
    top = max(others, key=lambda n: hit[n])
    return [f"- Workload 5 (issue 34): {gp} TTFT p90 {ms(p90[gp])} ms vs the best other, {best}, "
            f"{ms(p90[best])} ms ({_ok(p90[gp] <= p90[best])}; 90% interval of the ratio "
            f"{lo:.2f}x-{hi:.2f}x: {_distinct(lo, hi)}); hit rate {hit[gp]:.0%} vs {top} "
            f"{hit[top]:.0%} ({_ok(hit[gp] >= hit[top])})"]  # fmt: skip


def ratio_interval(ours: Runs, theirs: Runs, key: str, q: float = 50,
                   draws: int = 2000) -> tuple[float, float]:  # fmt: skip
    """A 90% bootstrap interval of the ratio of two routers' pooled percentiles: each draw
    resamples every round's requests with replacement (rounds kept apart: the machine's drift
    between rounds is not the routers' doing). Seeded, so a report redraws the same."""
    rng = random.Random(0)

    def draw(runs: Runs) -> float:
        xs: list[float] = []
        for r in runs:
            got = [x for x in r[key] if x == x]
            xs += rng.choices(got, k=len(got))
        return pct(xs, q)

    ratios = sorted(draw(ours) / draw(theirs) for _ in range(draws))
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def _distinct(lo: float, hi: float) -> str:
    if hi < 1:
        return "gpupool lower"
    return "gpupool higher" if lo > 1 else "not distinguishable"


def paired_long(rs: dict[str, Runs], peers: list[str]) -> list[str]:
    """gpupool against each peer over the long requests that both served (same prompts, same
    places in the round): a peer that fails a long request has no TTFT for it, so its pooled
    figure leaves out the requests it sent to a window too small."""
    gp = rs.get("gpupool", [])
    if not gp or "long_each" not in gp[0]:
        return []
    parts, wins = [], True
    for peer in peers:
        ours: list[float] = []
        theirs: list[float] = []
        for a, b in zip(gp, rs[peer], strict=False):
            for x, y in zip(a.get("long_each", []), b.get("long_each", []), strict=False):
                if x is not None and y is not None:
                    ours.append(x)
                    theirs.append(y)
        if not ours:
            continue
        mine, other = pct(ours, 50), pct(theirs, 50)
        wins = wins and mine < other
        parts.append(f"{peer} {ms(mine)} vs {ms(other)} ms ({len(ours)})")
    if not parts:
        return []
    return [f"  - on the same long requests (gpupool vs the peer, p50, requests both served): "
            f"{'; '.join(parts)}: {_ok(wins)}"]  # fmt: skip


def all_long(rs: dict[str, Runs], peers: list[str]) -> list[str]:
    """Every long request's TTFT, a failed one counting as never answered: what a client that
    sent them all got (a p50 past the answered ones is 'failed')."""
    if not rs.get("gpupool") or "long_each" not in rs["gpupool"][0]:
        return []

    def p50(name: str) -> float:
        xs = [math.inf if x is None else x for r in rs[name] for x in r.get("long_each", [])]
        return pct(xs, 50) if xs else math.nan

    def show(x: float) -> str:
        return "failed" if x == math.inf else ms(x)

    mine = p50("gpupool")
    theirs = {n: p50(n) for n in peers if rs[n] and "long_each" in rs[n][0]}
    if not theirs:
        return []
    wins = all(mine < t for t in theirs.values())
    return [f"  - over every long request sent, a failed one counting as never answered (p50): "
            f"gpupool {show(mine)} ms; " + "; ".join(f"{n} {show(t)}" for n, t in theirs.items())
            + f": {_ok(wins)}"]  # fmt: skip


def ordered(res: dict[str, Any], runs: dict[str, Runs]) -> dict[str, Runs]:
    """The routers in the order they were given (gpupool first), not the order they first ran."""
    names = [n for n in res.get("order", []) if n in runs] or list(runs)
    return {n: runs[n] for n in names}


KEY = {  # workload: (label, sample key, percentile)
    "multi_turn": ("TTFT p50", "ttft", 50),
    "mixed": ("long TTFT p50", "long_ttft", 50),
    "flood": ("interactive p99 under the flood", "flood", 99),
    "uneven": ("latency p99", "latency", 99),
    "tenants": ("TTFT p90", "ttft", 90),
}


def versus_base(res: dict[str, Any]) -> list[str]:
    """gpupool against another revision of itself (``gpupool@REV``) in the same run."""
    out = []
    for wl, (label, key, q) in KEY.items():
        runs = res["runs"].get(wl, {})
        for base in (n for n in runs if n.startswith("gpupool@")):
            mode = base.partition(":")[2]  # gpupool@REV:precise beside gpupool:precise
            ours = "gpupool" + (f":{mode}" if mode else "")
            if ours not in runs:  # only other revisions ran: nothing to compare them with
                continue
            new, old = pct(pooled(runs[ours], key), q), pct(pooled(runs[base], key), q)
            rounds = ", ".join(
                f"{pct(a[key], q) / pct(b[key], q):.2f}x"
                for a, b in zip(runs[ours], runs[base], strict=False)
            )
            out.append(f"- {TABLES[wl][0]}: {label} {ms(new)} ms ({ours}) vs {base} {ms(old)} "
                       f"ms ({new / old:.2f}x; per round {rounds})")  # fmt: skip
    return out


def _footprint(res: dict[str, Any]) -> list[str]:
    """Workload 1's conversations against the workers' KV caches (the regime it measures)."""
    kv, sz = res.get("kv_tokens") or {}, res.get("sizes", {})
    if not kv or "conversations" not in sz:
        return []
    one = sz["system_tokens"] + sz["turns"] * sz["turn_tokens"] + (sz["turns"] - 1) * sz[
        "reply_tokens"]  # fmt: skip
    total = sz["conversations"] * one
    caches = ", ".join(f"{n} {t:,}" for n, t in kv.items() if t)
    return [f"KV cache per worker (tokens, from its start-up log): {caches}. Workload 1's "
            f"{sz['conversations']} conversations hold about {total:,} prompt tokens at their "
            f"last turn: more than one worker's cache, less than the pool's.", ""]  # fmt: skip


def _tenants_shape(res: dict[str, Any]) -> list[str]:
    sz, cost, kv = res.get("sizes", {}), res.get("tenant_cost") or {}, res.get("kv_tokens") or {}
    if not cost or "tenants" not in sz:
        return []
    caches = [t for t in kv.values() if t]
    one = f" (one worker's cache: {min(caches):,})" if caches else ""
    return [f"Workload 5: {sz['tenants']} tenants with {sz['tenant_prefix_tokens']:,}-token "
            f"prefixes, {sz['tenants'] * sz['tenant_prefix_tokens']:,} tokens together{one}; "
            f"{sz['question_tokens']}-token questions. A request took {ms(cost['miss_s'])} ms "
            f"on an idle worker with its prefix not cached, {ms(cost['hit_s'])} ms cached; "
            f"arrivals (Poisson) {sz['tenants_gap_s']} s apart on average for "
            f"{sz['tenants_s']:.0f} s: half of them cached would be {sz['tenants_load']:.0%} "
            f"of the pool's time one at a time.", ""]  # fmt: skip


def _calibration(res: dict[str, Any]) -> list[str]:
    sz, prefill = res.get("sizes", {}), res.get("long_prefill_s")
    if prefill is None or "mixed_long_load" not in sz:
        return []
    load = sz["mixed_long_load"]
    return [f"Workload 2's pace: a {sz['long_tokens']:,}-token prefill took {ms(prefill)} ms on "
            f"the idle long worker, so its requests came {sz['mixed_gap_s']} s apart (the long "
            f"ones' prefills about {load:.0%} of that worker's time).", ""]  # fmt: skip


def _where(w: dict[str, Any]) -> str:
    if w.get("gpus"):
        return f"GPU {w['gpus']} at gpu-memory-utilization {w['gpu_memory']}"
    return f"CPUs {w['cpus']}"


def markdown(res: dict[str, Any]) -> str:
    m = res.get("model", {})
    lines = ["# Routing quality on real vLLM", "",
             f"Run started {res.get('started', '?')}, {res.get('wall_s', 0) / 60:.0f} min. "
             f"Model: random-weight Qwen3, hidden {m.get('hidden_size')}, "
             f"{m.get('num_hidden_layers')} layers (`--load-format dummy`, "
             f"`--dtype {res.get('dtype', 'bfloat16')}`). Workers: "
             + ", ".join(f"{w['name']} (window {w['window']}, {_where(w)}, max-num-seqs "
                         f"{w['max_num_seqs']})" for w in res.get("workers", []))
             + ". Versions: " + ", ".join(f"{k} {v}" for k, v in res.get("versions", {}).items())
             + ". Percentiles pool every round's requests; 'per round' gives the min-max of the "
               "rounds' own percentile (the noise of the machine).", "",
             *_footprint(res),
             *_calibration(res),
             *_tenants_shape(res),
             *([f"Routers renamed after the run: {res['renamed']}."] if "renamed" in res else []),
             "", "## Targets (issue 15)", "", *targets(res)]  # fmt: skip
    if any(n.startswith("gpupool@") for r in res["runs"].values() for n in r):
        lines += ["", "## gpupool against other revisions of its routing (same run)", "",
                  *versus_base(res)]  # fmt: skip
    for wl, (title, head, rows) in TABLES.items():
        if wl in res["runs"]:
            n = len(next(iter(res["runs"][wl].values())))
            lines += ["", f"## {title}", "", f"{n} round(s).", "",
                      *_table(head, rows(ordered(res, res["runs"][wl]))), "",
                      f"![{wl}]({wl}.png)"]  # fmt: skip
    return "\n".join(lines) + "\n"


# ---- plots ------------------------------------------------------------------------------------

PLOTS = {
    "multi_turn": [("TTFT p50", "ttft", 50), ("TTFT p99", "ttft", 99)],
    "mixed": [("long TTFT p50", "long_ttft", 50), ("short TTFT p50", "short_ttft", 50)],
    "flood": [("interactive p99 idle", "idle", 99), ("interactive p99 under flood", "flood", 99)],
    "uneven": [("latency p50", "latency", 50), ("latency p99", "latency", 99)],
    "tenants": [("TTFT p50", "ttft", 50), ("TTFT p90", "ttft", 90)],
}


def plot(wl: str, runs: dict[str, Runs], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    series = PLOTS[wl]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(series)
    for i, (label, key, q) in enumerate(series):
        xs = [j + i * width for j in range(len(names))]

        def finite(x: float) -> float:  # a never-answered percentile: no bar
            return x if x != math.inf else math.nan

        ys = [finite(pct(pooled(runs[n], key), q) * 1e3) for n in names]
        per_round = [[finite(pct(r[key], q) * 1e3) for r in runs[n]] for n in names]
        answered = [[x for x in v if x == x] for v in per_round]
        lo = [
            max(0.0, y - min(v)) if y == y and v else 0 for y, v in zip(ys, answered, strict=True)
        ]
        hi = [
            max(0.0, max(v) - y) if y == y and v else 0 for y, v in zip(ys, answered, strict=True)
        ]
        ax.bar(xs, [y if y == y else 0 for y in ys], width, label=label, yerr=[lo, hi], capsize=3)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels([n.replace(":", "\n") for n in names], fontsize=8)
    ax.set_ylabel("ms (bars: all rounds; whiskers: min-max of rounds)")
    ax.set_title(TABLES[wl][0])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(res: dict[str, Any], out: Path, final: bool = False) -> None:
    (out / "results.json").write_text(json.dumps(res, indent=1))
    if not final:
        return
    (out / "results.md").write_text(markdown(res))
    for wl, runs in res["runs"].items():
        plot(wl, ordered(res, runs), out / f"{wl}.png")
