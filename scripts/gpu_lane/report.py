"""Reports of the GPU lane: one phase's Markdown, and docs/gpu.md's results table.

    python3 scripts/gpu_lane/report.py DIR...     # DIR holds result-<phase>.json (a run's $OUT)

copies each result to ``docs/gpu/<date>-<phase>.json``, writes ``docs/gpu/<date>-<phase>.md`` and
regenerates the table between the markers in ``docs/gpu.md`` from every JSON in ``docs/gpu/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _g(d: Any, *keys: Any) -> Any:
    for k in keys:
        if not isinstance(d, dict | list):
            return None
        try:
            d = d[k]
        except (KeyError, IndexError, TypeError):
            return None
    return d


def _f(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def gpu_name(r: dict[str, Any]) -> str:
    gpus = _g(r, "hardware", "gpus") or []
    if not gpus:
        return "?"
    names = {g.get("name") for g in gpus}
    return f"{len(gpus)}x " + "/".join(sorted(str(n) for n in names))


def _workers(r: dict[str, Any], label: str = "launch") -> dict[str, Any]:
    return _g(r, label, "workers") or {}


def compile_times(r: dict[str, Any], label: str = "launch") -> str:
    parts = []
    for name, w in _workers(r, label).items():
        f = w.get("figures", {})
        c, cached = f.get("torch_compile_s"), f.get("compile_cache_load_s")
        parts.append(f"{name} {_f(c)}" + (f" (cache load {cached})" if cached is not None else ""))
    return ", ".join(parts) or "-"


def planner_cell(r: dict[str, Any]) -> str:
    cells = []
    for name, p in (_g(r, "planner") or {}).items():
        if isinstance(p, dict) and "kv_tokens_err_pct" in p:
            cells.append(f"{name} {_f(p['kv_tokens_err_pct'], '{:+.2f} %')}")
    return ", ".join(cells) or "-"


def kill_cell(r: dict[str, Any]) -> str:
    k = _g(r, "kill")
    if not isinstance(k, dict) or "recovered" not in k:
        return "-"
    events = sum(v for kind, v in (k.get("client_outcomes") or {}).items() if "error event" in kind)
    back = "back" if k["recovered"] else "NOT back"
    return f"{back} in {_f(k.get('ready_again_after_s'))} s, {events} error events"


def pitfall_cell(r: dict[str, Any]) -> str:
    cells = []
    for label in ("pitfall_cold", "pitfall_warm"):
        p = _g(r, label)
        if isinstance(p, dict) and "first" in p:
            ok = sum(1 for b in p.get("burst", []) if b.get("status") == 200)
            cells.append(
                f"{p['cache']}: {p['first']['kind']}, TTFT {_f(p['first']['ttft_ms'])} ms, "
                f"burst {ok}/{len(p.get('burst', []))}"
            )
    return "; ".join(cells) or "-"


def throughput_cell(r: dict[str, Any]) -> str:
    """Ratios gpupool/direct: wave rounds (fixed request count), steady state, one worker."""
    cells = []
    for key, label in (("throughput", "waves"), ("steady", "steady"), ("single", "one worker")):
        t = _g(r, key) or {}
        if t.get("rounds"):
            ratios = ", ".join(f"{x['ratio']:.3f}" for x in t["rounds"])
            cells.append(f"{label} {_f(t.get('ratio'), '{:.3f}')} ({ratios})")
    return "; ".join(cells) or "-"


def ready_cell(r: dict[str, Any]) -> str:
    cold, warm = _g(r, "launch", "ready_after_s"), _g(r, "launch_warm", "ready_after_s")
    return _f(cold) + (f" (warm cache {warm})" if warm is not None else "")


def row(r: dict[str, Any], link: str) -> list[str]:
    m, a = r.get("meta", {}), _g(r, "affinity") or {}
    stop = _g(r, "stop") or {}
    warm = compile_times(r, "launch_warm") if _g(r, "launch_warm") else ""
    return [
        m.get("date", "?"),
        m.get("phase", "?"),
        _f(_g(r, "hardware", "versions", "vllm")),
        gpu_name(r),
        ready_cell(r),
        compile_times(r) + (f"; warm cache: {warm}" if warm else ""),
        {True: "ok", False: "FAIL", None: "-"}[_g(r, "routing", "all_ok")],
        planner_cell(r),
        throughput_cell(r),
        _f(_g(r, "ttft", "p50_diff_ms"), "{:+.2f}"),
        kill_cell(r),
        _f(_g(r, "drain", "ready_after_restart_s"), "drained, back in {} s"),
        {True: "yes", False: "NO", None: "-"}[stop.get("all_freed")],
        f"{_f(_g(a, 'gpupool', 'hit_rate'))} / {_f(_g(a, 'round-robin', 'hit_rate'))}",
        pitfall_cell(r),
        f"[{link}]({link})" if link.endswith(".md") else link,
    ]


HEADER = [
    "date",
    "phase",
    "vLLM",
    "GPU",
    "ready (s)",
    "torch.compile (s)",
    "routing",
    "planner KV tokens vs vLLM",
    "tok/s gpupool/direct (rounds)",
    "TTFT p50 Δ ms",
    "kill -9 under load",
    "drain + restart",
    "stop frees GPUs",
    "prefix hit rate gpupool / RR",
    "seed 000 pitfall",
    "report",
]


def table(results: list[tuple[dict[str, Any], str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r, link in sorted(
        results, key=lambda x: x[0].get("meta", {}).get("date", ""), reverse=True
    ):
        lines.append("| " + " | ".join(row(r, link)) + " |")
    return "\n".join(lines)


def render_phase(r: dict[str, Any]) -> str:
    """One phase's report: the summary row, then every step's figures as JSON blocks."""
    m = r.get("meta", {})
    out = [
        f"# GPU lane: {m.get('phase')} phase, {m.get('date')}",
        "",
        f"GPU: {gpu_name(r)}; versions: {json.dumps(_g(r, 'hardware', 'versions'))}; "
        f"model shape `{m.get('shape')}`, config `{m.get('config')}`; "
        f"elapsed {r.get('elapsed_s')} s of {m.get('budget_s')} s.",
        "",
        table([(r, "this file")]),
        "",
    ]
    not_run = r.get("not_run") or {}
    if not_run:
        out += ["## Not run", ""] + [f"- `{k}`: {v}" for k, v in not_run.items()] + [""]
    skip = {"meta", "not_run", "gpu_memory_timeline", "elapsed_s"}
    for key, value in r.items():
        if key in skip:
            continue
        out += [
            f"## {key}",
            "",
            "```json",
            json.dumps(value, indent=1, default=str)[:20000],
            "```",
            "",
        ]
    timeline = r.get("gpu_memory_timeline") or []
    if timeline:
        out += ["## GPU memory used (MiB), every 5 s", "", "```"]
        out += [f"{t:7.1f}s  {used}" for t, used in timeline] + ["```", ""]
    return "\n".join(out)


def publish(src_dirs: list[Path]) -> list[Path]:
    """Copy each result into docs/gpu/ with its report; regenerate docs/gpu.md's table."""
    gpu_dir = DOCS / "gpu"
    gpu_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for d in src_dirs:
        for src in sorted(d.glob("result-*.json")):
            r = json.loads(src.read_text())
            m = r.get("meta", {})
            stem = m.get("date", "undated").replace(" UTC", "").replace(" ", "-").replace(":", "")
            stem = f"{stem}-{m.get('phase', 'phase')}"
            (gpu_dir / f"{stem}.json").write_text(json.dumps(r, indent=1) + "\n")
            (gpu_dir / f"{stem}.md").write_text(render_phase(r))
            written.append(gpu_dir / f"{stem}.md")
    regenerate_table()
    return written


def regenerate_table() -> None:
    results = [
        (json.loads(p.read_text()), f"gpu/{p.with_suffix('.md').name}")
        for p in sorted((DOCS / "gpu").glob("*.json"))
    ]
    doc = DOCS / "gpu.md"
    text = doc.read_text() if doc.exists() else f"# gpupool on GPUs\n\n{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{START}\n{table(results)}\n{END}{tail}")


if __name__ == "__main__":
    for path in publish([Path(a) for a in sys.argv[1:]]):
        print("wrote", path.relative_to(ROOT))
    print("updated docs/gpu.md")
