"""Reports of the GPU lane: one phase's Markdown, and docs/gpu.md's results table.

    python3 scripts/gpu_lane/report.py DIR...     # DIR holds result-<phase>.json (a run's $OUT)

copies each result to ``docs/gpu/<date>-<phase>.json``, writes ``docs/gpu/<date>-<phase>.md`` and
regenerates the table between the markers in ``docs/gpu.md`` from every JSON in ``docs/gpu/``.

Every result carries what it measured: the lane's check records the gpupool package it ran
(``meta.gpupool_tree``: a fingerprint of its files as git blob ids, and the commit and whether
the tree was clean where git is at hand). The machine gets no ``.git``, so here, when a result
is published, the fingerprint is looked up among the last commits (``meta.commit``,
``meta.clean``: no commit matches → measured an uncommitted tree). The table shows the commit
and flags a row older than the last change under ``gpupool/gateway/routing/`` or ``admission/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"
PACKAGE = "gpupool"
FINGERPRINTED = (".py", ".json")
ROUTING_PATHS = ("gpupool/gateway/routing", "gpupool/gateway/admission")
SEARCH_COMMITS = 400


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _fingerprint(entries: list[tuple[str, str]]) -> str:
    text = "\n".join(f"{path} {blob}" for path, blob in sorted(entries))
    return hashlib.sha256(text.encode()).hexdigest()


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def tree_identity(package_dir: Path | None = None) -> dict[str, Any]:
    """What gpupool this process would run: its files' fingerprint, and (with git) the commit."""
    here = Path.cwd() / PACKAGE
    if package_dir is None and (here / "__init__.py").is_file():
        package_dir = here  # `python -m gpupool` (the lane's serve) imports from the cwd first
    if package_dir is None:
        spec = importlib.util.find_spec(PACKAGE)
        locations = list(spec.submodule_search_locations or []) if spec else []
        package_dir = Path(locations[0]) if locations else ROOT / PACKAGE
    entries = [
        (f"{PACKAGE}/{p.relative_to(package_dir).as_posix()}", _blob_id(p.read_bytes()))
        for p in package_dir.rglob("*")
        if p.suffix in FINGERPRINTED and p.is_file() and "__pycache__" not in p.parts
    ]
    out: dict[str, Any] = {
        "fingerprint": _fingerprint(entries),
        "files": len(entries),
        "from": str(package_dir),
    }
    head = _git("rev-parse", "HEAD") if (ROOT / ".git").exists() else None
    if head and package_dir.resolve() == (ROOT / PACKAGE).resolve():
        out["commit"] = head.strip()
        out["clean"] = _git("status", "--porcelain", "--", PACKAGE) == ""
    return out


def commit_fingerprint(commit: str) -> str | None:
    listing = _git("ls-tree", "-r", commit, "--", PACKAGE)
    if listing is None:
        return None
    entries = []
    for line in listing.splitlines():
        meta, _, path = line.partition("\t")
        if Path(path).suffix in FINGERPRINTED:
            entries.append((path, meta.split()[2]))
    return _fingerprint(entries)


def resolve_commit(identity: dict[str, Any]) -> tuple[str | None, bool | None]:
    """(commit, clean) of a measured tree: as recorded, else the commit whose gpupool/ has the
    same fingerprint (clean), else (None, False): an uncommitted tree."""
    if identity.get("commit"):
        return identity["commit"], identity.get("clean")
    wanted = identity.get("fingerprint")
    commits = _git("rev-list", f"--max-count={SEARCH_COMMITS}", "HEAD")
    if not wanted or commits is None:
        return None, None
    for commit in commits.split():
        if commit_fingerprint(commit) == wanted:
            return commit, True
    return None, False


def routing_change_since(commit: str) -> str | None:
    """The newest commit after ``commit`` that changed routing or admission (short hash, date)."""
    out = _git("log", "-1", "--format=%h %cs", f"{commit}..HEAD", "--", *ROUTING_PATHS)
    return out.strip() or None if out is not None else None


def commit_cell(r: dict[str, Any]) -> str:
    m = r.get("meta", {})
    commit = m.get("commit")
    if not commit:
        return "uncommitted tree" if m.get("clean") is False else "not recorded"
    cell = commit[:8] + ("" if m.get("clean", True) else " + changes")
    newer = routing_change_since(commit)
    return cell + (f" (older than routing/admission {newer})" if newer else "")


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
    if not gpus:  # planner_shapes.py records the card in meta ("NVIDIA H100 80GB HBM3, 81559 MiB")
        return str(_g(r, "meta", "gpu") or "?").split(",")[0] or "?"
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
    for name, case in (_g(r, "cases") or {}).items():  # planner_shapes.py
        err = _g(case, "compare", "kv_tokens_err_pct")
        cells.append(f"{name} {_f(err, '{:+.2f} %')}")
    return ", ".join(cells) or "-"


def kill_cell(r: dict[str, Any]) -> str:
    k = _g(r, "kill")
    if not isinstance(k, dict) or "recovered" not in k:
        return "-"
    events = sum(v for kind, v in (k.get("client_outcomes") or {}).items() if "error event" in kind)
    back = "back" if k["recovered"] else "NOT back"
    cell = f"{back} in {_f(k.get('ready_again_after_s'))} s, {events} error events"
    if "client_errors" in k:  # since request migration (issue 36)
        cell += f", {k['client_errors']} client errors, {k.get('migrated_streams', 0)} migrated"
    gap = k.get("next_token_gap_ms") or {}
    if gap.get("n"):  # the streams running on the killed worker: their wait for the next token
        cell += f", next token p50 {gap['p50']} ms (max {gap['max']}, {gap['n']} streams)"
    return cell


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


def swap_cell(r: dict[str, Any]) -> str:
    """The sleep phases (lane_sleep.py): level-1 and level-2 switches, the level-2 canary, the
    alternations, the mixed load and a switch's pause."""
    cells = []
    l1 = _g(r, "switch_l1", "switch_ttft") or {}
    if l1.get("n"):
        cells.append(f"L1 switch p50 {_f(l1.get('p50'))} s")
    restart = _g(r, "cold_restart", "restart_to_first_token_s")
    if restart is not None:
        cells.append(f"restart {_f(restart)} s")
    alt = _g(r, "alternate") or {}
    if alt.get("requests"):
        cells.append(f"{alt['requests']} alternations, {alt.get('failures')} failed")
    l2 = _g(r, "switch_l2") or {}
    if l2.get("runs") and "restarts_instead" not in l2:  # before 5bcc1fe: dummy weights, restarts
        cells.append("L2 not measured (its wakes were restarts)")
    elif l2.get("runs"):
        canary = l2.get("canary") or {}
        cells.append(
            f"L2 switch p50 {_f(_g(l2, 'switch_ttft', 'p50'))} s "
            f"({l2.get('restarts_instead')} restarts instead, {l2.get('failures')} failed)"
            + (f", canary same {canary['same_after_wake']}/{canary['runs']}" if canary else "")
        )
    mixed = _g(r, "mixed") or {}
    if mixed.get("requests"):
        cells.append(f"mixed {mixed['requests']} requests, {mixed.get('failures')} failed")
    pause = _g(r, "pause") or {}
    if "stream_whole" in pause:
        stream = pause.get("stream") or {}
        cells.append(
            f"pause: {_f(pause.get('paused_requests'), '{:.0f}')} paused, stall "
            f"{_f(stream.get('longest_gap_s'))} s, {_f(stream.get('completion_tokens'))} tokens "
            f"{'whole' if pause['stream_whole'] else 'NOT whole'}, text "
            f"{'as unpaused' if pause.get('same_text_as_unpaused') else 'differs'}"
        )
    kv = _g(r, "kv_sleep") or {}
    if "asleep" in kv:
        asks = [kv.get(k) or {} for k in ("first", "second", "wake", "again")]
        exact = sum(a.get("prediction") == "exact" for a in asks)
        cells.append(
            f"KV index {_g(kv, 'awake', 'blocks')} blocks awake, {_g(kv, 'asleep', 'blocks')} "
            f"asleep; cached tokens {'/'.join(str(a.get('cached_tokens')) for a in asks)}, "
            f"{exact} predicted exactly"
        )
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
        commit_cell(r),
        _f(_g(r, "hardware", "versions", "vllm") or m.get("vllm")),
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
        swap_cell(r),
        f"[{link}]({link})" if link.endswith(".md") else link,
    ]


HEADER = [
    "date",
    "phase",
    "gpupool commit",
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
    "sleep mode / swap",
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
            m = r.setdefault("meta", {})
            if "commit" not in m:
                m["commit"], m["clean"] = resolve_commit(m.get("gpupool_tree") or {})
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
    doc.write_text(f"{head}{START}\n{stale_note(results)}{table(results)}\n{END}{tail}")


def stale_note(results: list[tuple[dict[str, Any], str]]) -> str:
    """A line over the table: which rows measured code older than routing's or admission's."""
    last = _git("log", "-1", "--format=%h %cs", "--", *ROUTING_PATHS)
    if not last:
        return ""
    old = [
        f"{r.get('meta', {}).get('date', '?')} {r.get('meta', {}).get('phase', '?')}"
        for r, _ in results
        if not r.get("meta", {}).get("commit") or routing_change_since(r["meta"]["commit"])
    ]
    if not old:
        return f"Every row measured the routing and admission of {last.strip()} or later.\n\n"
    return (
        f"Routing or admission last changed in {last.strip()}; rows measured before it, or "
        f"whose commit was not recorded, do not show that code: {', '.join(old)}.\n\n"
    )


if __name__ == "__main__":
    for path in publish([Path(a) for a in sys.argv[1:]]):
        print("wrote", path.relative_to(ROOT))
    print("updated docs/gpu.md")
