"""Results: the console lines, ``results.md`` (table, rig-bound marks, targets) and ``chart.png``.

A figure is marked **rig-bound** (†) when it says more about the rig than the gateway: CPU0 (the
upstream and the load generator) was saturated, or the upstream reached directly is within ~10 %
of the gateway's figure, so the gateway's own cost is below what this rig can resolve.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PACE_MS = 20.0
GATEWAYS_ORDER = ("gpupool", "gpupool-precise", "gpupool-base", "gpupool-redis", "aiohttp-naive",
                  "vllm-router", "sglang-router", "litellm")  # fmt: skip


def _f(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


# ---- console --------------------------------------------------------------------------------


def print_latency(lat: dict[str, Any]) -> None:
    d = lat.get("direct")
    if not d:
        return
    for name, r in lat.items():
        added = ""
        if name != "direct":
            p50, p99 = r["p50_ms"] - d["p50_ms"], r["p99_ms"] - d["p99_ms"]
            added = f"  added p50 {p50:.3f} / p99 {p99:.3f} ms"
        print(
            f"  {name:>14}: p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms{added}", flush=True
        )


def print_stream(st: dict[str, Any]) -> None:
    for name, r in st.items():
        print(
            f"  {name:>14}: TTFT p50 {r['ttft_p50_ms']:.2f} ms, gap p50/p99 "
            f"{r['gap_p50_ms']:.2f}/{r['gap_p99_ms']:.2f} ms, chunk delay p50/p99 "
            f"{r['delay_p50_ms']:.2f}/{r['delay_p99_ms']:.2f} ms, errors {r['errors']}, "
            f"identical bytes {r['bytes_identical_to_direct']}",
            flush=True,
        )


def print_rate(rate: dict[str, Any]) -> None:
    for name, r in rate.items():
        print(
            f"  {name:>14}: {r['max_rps_10ms']} rps at p99 < 10 ms; "
            f"{r['max_rps_50ms']} rps at p99 < 50 ms",
            flush=True,
        )


# ---- analysis -------------------------------------------------------------------------------


def analyse(res: dict[str, Any]) -> dict[str, Any]:
    """Added figures, rig-bound marks and ratios, per target."""
    out: dict[str, Any] = {}
    lat, st, rate, mem = (res.get(k, {}) for k in ("latency", "stream", "rate", "memory"))
    d_lat, d_st, d_rate = lat.get("direct"), st.get("direct"), rate.get("direct")
    for name in res.get("targets", {}):
        a: dict[str, Any] = {"rig": []}
        if name in lat and d_lat:
            r = lat[name]
            a["added_p50_ms"] = r["p50_ms"] - d_lat["p50_ms"]
            a["added_p99_ms"] = r["p99_ms"] - d_lat["p99_ms"]
            if name != "direct" and d_lat["p50_ms"] >= 0.9 * r["p50_ms"]:
                a["rig"].append("latency")
        if name in st and d_st:
            r = st[name]
            a["added_ttft_ms"] = r["ttft_p50_ms"] - d_st["ttft_p50_ms"]
            a["added_gap_p99_ms"] = r["gap_p99_ms"] - d_st["gap_p99_ms"]
            a["added_delay_p99_ms"] = r["delay_p99_ms"] - d_st["delay_p99_ms"]
            jitter = d_st["gap_p99_ms"] - PACE_MS  # what the rig itself adds to a 20 ms gap
            a["rig_gap_jitter_ms"] = jitter
            if name != "direct" and d_st["ttft_p50_ms"] >= 0.9 * r["ttft_p50_ms"]:
                a["rig"].append("ttft")
            if name != "direct" and abs(a["added_gap_p99_ms"]) < max(0.1, jitter):
                a["rig"].append("gap")
        if name in rate:
            a.update(_rate_marks(name, rate[name], d_rate))
            if name in lat and lat[name]["p50_ms"] >= 10.0:
                a["rig_rate"] = False
                a["rate_why"] = f"its c=1 p50 is already {lat[name]['p50_ms']:.1f} ms"
        if name in mem:
            a["memory"] = mem[name]
        out[name] = a
    return out


def _rate_marks(name: str, r: dict[str, Any], direct: dict[str, Any] | None) -> dict[str, Any]:
    """Why the rate stopped where it did, and whether that says more about the rig."""
    a: dict[str, Any] = {"rig_rate": False, "rate_why": ""}
    fail = r.get("fail_10ms") or {}
    rig_cpu = fail.get("client_cpu", 0.0) + fail.get("upstream_cpu", 0.0)
    if name == "direct":
        a["rig_rate"], a["rate_why"] = True, "the rig's own limit (upstream + client on CPU0)"
        if not fail:
            a["rate_why"] += "; never failed up to the last step"
    elif fail and rig_cpu >= 0.85:
        a["rig_rate"], a["rate_why"] = (
            True,
            f"the rig used {rig_cpu:.2f} of CPU0 at the failing step",
        )
    elif fail and fail.get("cpu0_busy", 0) >= 0.95:
        a["rig_rate"] = True
        a["rate_why"] = (
            f"CPU0 was saturated at the failing step ({rig_cpu:.2f} core rig, "
            f"{fail.get('cpu0_foreign', 0):.2f} core other processes)"
        )
    elif fail and fail.get("gateway_cpu", 1.0) < 0.8 and fail.get("cpu1_foreign", 0) > 0.2:
        a["rig_rate"] = True
        a["rate_why"] = (
            f"other processes took {fail['cpu1_foreign']:.2f} core of CPU1 at the "
            f"failing step (gateway got {fail['gateway_cpu']:.2f})"
        )
    elif direct and r["max_rps_10ms"] >= 0.9 * direct["max_rps_10ms"] > 0:
        a["rig_rate"], a["rate_why"] = True, "within 10 % of the upstream reached directly"
    elif fail and fail.get("gateway_cpu", 1.0) < 0.8:
        a["rate_why"] = f"gateway used only {fail['gateway_cpu']:.2f} core at the failing step"
    return a


def _ratio(x: float | None, y: float | None) -> float | None:
    if x is None or y is None or (isinstance(y, float) and math.isnan(y)):
        return None
    if y <= 0:
        return math.inf if x > 0 else None
    return x / y


def targets_met(res: dict[str, Any], an: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the figures, the ratio and whether it is met."""
    gp, vr = an.get("gpupool", {}), an.get("vllm-router", {})
    rate = res.get("rate", {})
    rows: list[dict[str, Any]] = []

    def add(goal: str, value: str, ratio: float | None, ok: bool | None, note: str = "") -> None:
        rows.append({"target": goal, "value": value, "ratio": ratio, "met": ok, "note": note})

    if "added_p50_ms" in gp and "added_p50_ms" in vr:
        r = _ratio(gp["added_p50_ms"], vr["added_p50_ms"])
        add(
            "added p50 ≤ 1.5x vllm-router's",
            f"{gp['added_p50_ms']:.3f} vs {vr['added_p50_ms']:.3f} ms",
            r,
            None if r is None else r <= 1.5,
        )
    if "gpupool" in rate and "vllm-router" in rate:
        g, v = rate["gpupool"]["max_rps_10ms"], rate["vllm-router"]["max_rps_10ms"]
        r = _ratio(g, v)
        note = (
            "vllm-router's figure is rig-bound: the true ratio is lower"
            if vr.get("rig_rate")
            else ""
        )
        add(
            "sustained rate ≥ 50 % of vllm-router's",
            f"{g} vs {v} rps",
            r,
            None if r is None else r >= 0.5,
            note,
        )
    if "gpupool" in rate and "litellm" in rate:
        g, lt = rate["gpupool"]["max_rps_10ms"], rate["litellm"]["max_rps_10ms"]
        r = _ratio(g, lt)
        note = ""
        if lt == 0:
            g50, l50 = rate["gpupool"]["max_rps_50ms"], rate["litellm"]["max_rps_50ms"]
            note = (
                f"LiteLLM never held p99 < 10 ms; at p99 < 50 ms: {g50} vs {l50} rps "
                f"({_fmt_ratio(_ratio(g50, l50))})"
            )
        add(
            "sustained rate ≥ 10x LiteLLM's",
            f"{g} vs {lt} rps",
            r,
            None if r is None else r >= 10,
            note,
        )
    if "added_gap_p99_ms" in gp:
        v, dly = gp["added_gap_p99_ms"], gp["added_delay_p99_ms"]
        note = (
            f"per-chunk delay p99 added: {dly:.3f} ms; the rig's own gap jitter (direct p99 "
            f"- 20 ms) is {gp['rig_gap_jitter_ms']:.2f} ms"
        )
        add("streaming added inter-chunk p99 < 1 ms", f"{v:.3f} ms", None, v < 1.0, note)
    level = gp.get("memory", {}).get("levels", {}).get("5000")
    if level:
        ok = level["rss_mb"] < 300 and level["established"] >= 4950
        add(
            "5,000 idle streams in < 300 MB RSS",
            f"{level['rss_mb']:.0f} MB with {level['established']} streams",
            None,
            ok,
        )
    rv = res.get("real_vllm", {})
    if "tokens_ratio" in rv:
        add(
            "through real vLLM ≥ 98 % of direct tokens/s",
            f"{rv['gateway']['tokens_per_s']:.1f} vs {rv['direct']['tokens_per_s']:.1f} tok/s",
            rv["tokens_ratio"],
            rv["tokens_ratio"] >= 0.98,
        )
    return rows


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return "∞" if math.isinf(r) else f"{r:.2f}x"


# ---- markdown -------------------------------------------------------------------------------


def _dag(x: str, mark: bool) -> str:
    return f"{x} †" if mark and x != "-" else x


def _main_table(res: dict[str, Any], an: dict[str, Any]) -> list[str]:
    lat, st, rate = res.get("latency", {}), res.get("stream", {}), res.get("rate", {})
    head = (
        "| target | c=1 p50 / p99 ms | added p50 / p99 ms | max rps, p99 < 10 ms | "
        "rps, p99 < 50 ms | CPU µs/req | stream TTFT added ms | inter-chunk p99 added ms | "
        "chunk delay p99 added ms | RSS idle / 1k / 5k streams MB |"
    )
    lines = [head, "|" + "---|" * 10]
    for name in res.get("targets", {}):
        a = an.get(name, {})
        c1 = f"{_f(lat[name]['p50_ms'], 3)} / {_f(lat[name]['p99_ms'], 3)}" if name in lat else "-"
        added = "-"
        if name in lat and name != "direct":
            added = _dag(
                f"{_f(a['added_p50_ms'], 3)} / {_f(a['added_p99_ms'], 3)}", "latency" in a["rig"]
            )
        r = rate.get(name, {})
        rps = _dag(str(r["max_rps_10ms"]), a.get("rig_rate", False)) if r else "-"
        rps50 = str(r["max_rps_50ms"]) if r else "-"
        cpu = _f(r.get("cpu_us_per_request"), 0) if r and name != "direct" else "-"
        ttft = gap = delay = "-"
        if name in st and name != "direct":
            ttft = _dag(_f(a["added_ttft_ms"]), "ttft" in a["rig"])
            gap = _dag(_f(a["added_gap_p99_ms"]), "gap" in a["rig"])
            delay = _f(a["added_delay_p99_ms"])
        elif name in st:
            ttft = f"({_f(st[name]['ttft_p50_ms'])} abs.)"
            gap = f"({_f(st[name]['gap_p99_ms'])} abs.)"
            delay = f"({_f(st[name]['delay_p99_ms'])} abs.)"
        mem = _mem_cell(a.get("memory"))
        lines.append(
            f"| {name} | {c1} | {added} | {rps} | {rps50} | {cpu} | {ttft} | {gap} | "
            f"{delay} | {mem} |"
        )
    return lines


def _mem_cell(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    cells = [f"{m['rss_idle_mb']:.0f}"]
    for level in ("1000", "5000"):
        lv = m["levels"].get(level)
        if lv is None:
            cells.append("-")
        elif lv["established"] < int(level) * 0.99:
            cells.append(f"{lv['rss_mb']:.0f} (only {lv['established']} open)")
        else:
            cells.append(f"{lv['rss_mb']:.0f}")
    return " / ".join(cells)


def _targets_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| target (issue #7) | gpupool vs reference | ratio | met | note |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        met = {True: "**yes**", False: "**no**", None: "-"}[r["met"]]
        lines.append(
            f"| {r['target']} | {r['value']} | {_fmt_ratio(r['ratio'])} | {met} | {r['note']} |"
        )
    return lines


def _stream_table(st: dict[str, Any]) -> list[str]:
    lines = [
        "| target | streams | errors | TTFT p50 / p99 ms | gap p50 / p99 / max ms | "
        "chunk delay p50 / p99 ms | events ≥ | bytes identical to direct |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in st.items():
        same = "yes" if r["bytes_identical_to_direct"] else "no"
        lines.append(
            f"| {name} | {r['streams']} | {r['errors']} | {_f(r['ttft_p50_ms'])} / "
            f"{_f(r['ttft_p99_ms'])} | {_f(r['gap_p50_ms'])} / {_f(r['gap_p99_ms'])} / "
            f"{_f(r['gap_max_ms'])} | {_f(r['delay_p50_ms'])} / {_f(r['delay_p99_ms'])} | "
            f"{r['events_min']} | {same} |"
        )
    return lines


def _rate_notes(rate: dict[str, Any], an: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in rate.items():
        fail = r.get("fail_10ms")
        why = an.get(name, {}).get("rate_why", "")
        if fail:
            lines.append(
                f"- **{name}**: first failing step {fail['rate']:g} rps: p99 "
                f"{fail['p99_ms']:.1f} ms, {fail['errors']} errors, gateway "
                f"{fail.get('gateway_cpu', 0):.2f} core, rig "
                f"{fail.get('client_cpu', 0) + fail.get('upstream_cpu', 0):.2f} core; "
                f"other processes {fail.get('cpu0_foreign', 0):.2f} core on CPU0, "
                f"{fail.get('cpu1_foreign', 0):.2f} on CPU1" + (f"; {why}" if why else "") + "."
            )
        elif why:
            lines.append(f"- **{name}**: {why}.")
    return lines


def _admission_lines(adm: dict[str, Any]) -> list[str]:
    lines = [
        "| backend | acquire + release p50 µs | p99 µs | saturated grants/s |",
        "|---|---|---|---|",
    ]
    for b in ("memory", "redis"):
        if b in adm:
            r = adm[b]
            lines.append(f"| {b} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {r['grants_per_s']} |")
    return lines


def _real_vllm_lines(rv: dict[str, Any]) -> list[str]:
    if "error" in rv or "direct" not in rv:
        return [f"Not measured: {rv.get('error', 'skipped')}."]
    d, g = rv["direct"], rv["gateway"]
    return [
        f"{rv['describe']}",
        "",
        "| path | tokens/s | TTFT p50 / p99 ms | requests |",
        "|---|---|---|---|",
        f"| direct | {d['tokens_per_s']:.1f} | {d['ttft_p50_ms']:.1f} / {d['ttft_p99_ms']:.1f} "
        f"| {d['requests']} |",
        f"| through gpupool | {g['tokens_per_s']:.1f} | {g['ttft_p50_ms']:.1f} / "
        f"{g['ttft_p99_ms']:.1f} | {g['requests']} |",
        "",
        f"Through the gateway: **{rv['tokens_ratio']:.1%}** of direct tokens/s; TTFT p50 "
        f"{g['ttft_p50_ms'] - d['ttft_p50_ms']:+.1f} ms.",
    ]


def _spread(xs: list[float], digits: int = 3) -> str:
    return f"{min(xs):.{digits}f} to {max(xs):.{digits}f}" if xs else "-"


def _wrk_lines(w: dict[str, Any]) -> list[str]:
    if "error" in w:
        return [f"Not measured: {w['error']}"]
    s = w["summary"]
    ref = s.get("vllm-router", {})
    versions = ", ".join(f"{k} {v}" for k, v in w.get("versions", {}).items() if v)
    lines = [
        f"`wrk -t1 --latency`, POST `{w['body']}`; each gateway alone on CPU1, wrk and nginx "
        f"(answering from memory) on CPU0; {len(next(iter(w['rounds'].values())))} interleaved "
        f"rounds of {w['seconds']:g} s per figure, medians (range over rounds). "
        f"Versions: {versions}.",
        "",
        "| target | c=1 p50 / p99 ms | added p50 ms (range) | added p99 ms (range) "
        "| added p50 vs vllm-router | c=32 req/s (range) | vs vllm-router "
        "| CPU µs/req c=1 / c=32 (range c=1) | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in s.items():
        added = name != "direct"
        ratio = _ratio(v["added_p50_ms"], ref.get("added_p50_ms")) if added else None
        rate = _ratio(v["rps_c32"], ref.get("rps_c32")) if added else None
        lines.append(
            f"| {name} | {v['p50_ms']:.3f} / {v['p99_ms']:.3f} | "
            f"{_f(v['added_p50_ms'], 3) if added else '-'} "
            f"({_spread(v['added_p50_ms_all']) if added else '-'}) | "
            f"{_f(v['added_p99_ms'], 3) if added else '-'} "
            f"({_spread(v['added_p99_ms_all']) if added else '-'}) | "
            f"{_fmt_ratio(ratio)} | {v['rps_c32']:,.0f} ({_spread(v['rps_c32_all'], 0)}) | "
            f"{_fmt_ratio(rate)} | {_cpu_cell(v)} | {v['errors']} |"
        )
    return lines


def _cpu_cell(v: dict[str, Any]) -> str:
    if "c1_cpu_us" not in v:
        return "-"
    return f"{v['c1_cpu_us']:.0f} / {v['c32_cpu_us']:.0f} ({_spread(v['c1_cpu_us_all'], 0)})"


def _wrk_section(res: dict[str, Any]) -> list[str]:
    if not res.get("wrk"):
        return []
    title = "## Second client: wrk against an nginx upstream (bench/wrkbench.py)"
    return ["", title, "", *_wrk_lines(res["wrk"])]


def markdown(res: dict[str, Any]) -> str:
    an = analyse(res)
    meta = res["meta"]
    versions = ", ".join(
        f"{n} {t['version']}" for n, t in res.get("targets", {}).items() if t["version"]
    )
    out = [
        "# gpupool benchmark results",
        "",
        f"Run {meta['date']} on {meta['cpus']} x {meta['host_cpu']} (kernel {meta['kernel']}, "
        f"Python {meta['python']}){', quick mode' if meta.get('quick') else ''}. "
        f"Versions: {versions}. Gateway under test alone on CPU{meta['pinning']['gateway']}; "
        f"upstream and load generator on CPU{meta['pinning']['upstream_and_client']}; niceness "
        f"{meta['niceness']}. Load average {' '.join(meta['loadavg_start'])} at the start; the "
        f"machine averaged {meta.get('machine_busy_cores', '?')} busy cores over the gateway "
        f"phases. Whole run: {meta.get('total_s', 0):.0f} s. Method: docs/performance.md.",
        "",
        "† rig-bound: the figure is limited by the rig (CPU0 saturated, or the upstream reached "
        "directly is within ~10 % of it), not by the gateway.",
        "",
        *_main_table(res, an),
        "",
        "## Targets",
        "",
        *_targets_table(targets_met(res, an)),
    ]
    if res.get("rate"):
        out += ["", "## Highest rate: where each target stopped", "", *_rate_notes(res["rate"], an)]
    if res.get("stream"):
        out += [
            "",
            "## Streaming (64 chunks, one every 20 ms upstream; 8 streams at a time)",
            "",
            *_stream_table(res["stream"]),
        ]
    if res.get("memory"):
        out += [
            "",
            "## Idle streams",
            "",
            "| target | RSS idle MB | streams | RSS MB | KB/stream "
            "| seconds to open | RSS after close MB |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, m in res["memory"].items():
            for level, lv in m["levels"].items():
                out.append(
                    f"| {name} | {m['rss_idle_mb']:.0f} | {lv['established']}/{level} | "
                    f"{lv['rss_mb']:.0f} | {lv['kb_per_stream']:.1f} | {lv['open_s']} | "
                    f"{m['rss_after_mb']:.0f} |"
                )
    if res.get("admission"):
        out += [
            "",
            "## gpupool admission queue (bench/bench_admission.py, on CPU1, Redis on CPU0)",
            "",
            *_admission_lines(res["admission"]),
        ]
    out += _wrk_section(res)
    if res.get("real_vllm"):
        out += [
            "",
            "## Through real vLLM (CPU, tiny model)",
            "",
            *_real_vllm_lines(res["real_vllm"]),
        ]
    if res.get("profile"):
        out += ["", "## Profile", "", "See profile.md."]
    if res.get("errors"):
        out += ["", "## Phases that failed", ""]
        out += [f"- {name}: `{msg[:300]}`" for name, msg in res["errors"].items()]
    return "\n".join(out) + "\n"


# ---- chart ----------------------------------------------------------------------------------

COLORS = {"gpupool": "#1f77b4", "gpupool-redis": "#6baed6", "vllm-router": "#ff7f0e",
          "sglang-router": "#2ca02c", "litellm": "#d62728", "direct": "#7f7f7f"}  # fmt: skip


def _bars(ax: Any, labels: list[str], values: list[float], rig: list[bool], title: str,
          unit: str, shown: list[float] | None = None) -> None:  # fmt: skip
    xs = list(range(len(labels)))
    drawn = ax.bar(xs, values, color=[COLORS.get(n, "#999") for n in labels], edgecolor="black")
    for bar, mark in zip(drawn, rig, strict=False):
        if mark:
            bar.set_hatch("//")
    ax.set_xticks(xs, labels, rotation=20, ha="right")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.set_yscale("log")
    for x, v, text in zip(xs, values, shown or values, strict=False):
        ax.annotate(f"{text:.4g}", (x, v), ha="center", va="bottom", fontsize=8)


def _chart_latency(ax: Any, res: dict[str, Any], an: dict[str, Any]) -> None:
    names = [n for n in res.get("targets", {}) if n != "direct" and "added_p50_ms" in an.get(n, {})]
    if names:
        _bars(ax, names, [max(1e-3, an[n]["added_p50_ms"]) for n in names],
              ["latency" in an[n]["rig"] for n in names],
              "Added latency p50, c=1, non-streaming (lower is better)", "ms")  # fmt: skip


def _chart_rate(ax: Any, res: dict[str, Any], an: dict[str, Any]) -> None:
    names = [n for n in res.get("targets", {}) if n in res.get("rate", {})]
    if names:
        rates = [res["rate"][n]["max_rps_10ms"] for n in names]
        rig = [an[n].get("rig_rate", False) for n in names]
        title = "Highest rate with p99 < 10 ms, no errors (higher is better)"
        _bars(ax, names, [max(1, r) for r in rates], rig, title, "req/s", rates)


def _chart_stream(ax: Any, res: dict[str, Any], an: dict[str, Any]) -> None:
    names = [
        n for n in res.get("targets", {}) if n != "direct" and "added_gap_p99_ms" in an.get(n, {})
    ]
    if not names:
        return
    xs = list(range(len(names)))
    series = (("added_ttft_ms", "added TTFT p50", "#4c72b0"),
              ("added_gap_p99_ms", "added inter-chunk gap p99", "#dd8452"),
              ("added_delay_p99_ms", "added per-chunk delay p99", "#55a868"))  # fmt: skip
    for i, (key, label, color) in enumerate(series):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [an[n][key] for n in names], 0.27, label=label,
               color=color)  # fmt: skip
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(xs, names, rotation=20, ha="right")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=-0.5)
    ax.set_ylabel("ms")
    ax.set_title("Streaming, 64 chunks paced 20 ms (lower is better; dotted: 1 ms)", fontsize=10)
    ax.legend(fontsize=8)


def _chart_memory(ax: Any, res: dict[str, Any]) -> None:
    mem = res.get("memory", {})
    if not mem:
        return
    names = list(mem)
    xs = list(range(len(names)))
    for i, (key, label) in enumerate((("idle", "idle"), ("1000", "1,000 streams"),
                                      ("5000", "5,000 streams"))):  # fmt: skip
        vals = [mem[n]["rss_idle_mb"] if key == "idle"
                else mem[n]["levels"].get(key, {}).get("rss_mb", 0) for n in names]  # fmt: skip
        ax.bar([x + (i - 1) * 0.27 for x in xs], vals, 0.27, label=label)
    ax.axhline(300, color="black", linestyle=":", linewidth=1)
    ax.set_xticks(xs, names, rotation=20, ha="right")
    ax.set_ylabel("MB RSS (gateway process tree)")
    ax.set_title("Memory with idle open streams (dotted: 300 MB)", fontsize=10)
    ax.legend(fontsize=8)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    an = analyse(res)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    _chart_latency(axes[0][0], res, an)
    _chart_rate(axes[0][1], res, an)
    _chart_stream(axes[1][0], res, an)
    _chart_memory(axes[1][1], res)
    for ax in axes.flat:
        if not ax.has_data():
            ax.set_visible(False)
    title = f"gpupool bench, {res['meta']['date']}: gateway on 1 core (CPU1); hatched = rig-bound"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict[str, Any], out: Path) -> None:
    res["analysis"] = analyse(res)
    res["targets_met"] = targets_met(res, res["analysis"])
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "results.md").write_text(markdown(res))
    chart(res, out / "chart.png")
