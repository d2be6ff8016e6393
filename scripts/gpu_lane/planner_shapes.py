"""The planner against vLLM on model shapes the other phases do not serve (issue 25).

    python3 scripts/gpu_lane/planner_shapes.py --out DIR [--budget-s 560]

For each case (a shape from ``shapes/`` and vLLM flags), in order: make the model dir the way the
lane does (the shape's ``config.json`` + the offline tokenizer, dummy weights), start vLLM's API
server alone on GPU 0 at 0.90 utilization and 32K, read ``Available KV cache memory``, ``GPU KV
cache size`` and ``Maximum concurrency`` from its log, stop it, and compare with ``gpupool plan``
for the same flags and the card's NVML total (the repository copy's gpupool, whatever the bundle
carries). Cases run while time lasts; one that does not fit is listed under ``not_run``.

Startup is cut short without changing the figure: ``--load-format dummy`` (no weights read), and
each server is stopped once it has logged its KV cache and memory summary (vLLM sizes the cache
after its profile run and, for MoE/hybrid models, after profiling CUDA graphs; serving warm-up
comes later). The two Qwen3-MoE cases share one torch.compile cache. Nothing that changes the
profile is used: no ``--enforce-eager`` (it drops the CUDA-graph reserve), no ``-O0`` (compiled
graphs have other activation peaks), no lower ``--max-num-seqs``.

Writes at most three files to ``--out``: ``result-planner-shapes.json`` (after every case),
``report-planner-shapes.md`` and ``log-planner-shapes.txt`` (this script's log, then each
server's key lines and last lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # make_tiny_models, for a tokenizer when none is carried

import lane_gpu  # noqa: E402
import lane_logs  # noqa: E402
from lane_gateway import prepare_model  # noqa: E402
from lane_util import Lane, pct  # noqa: E402
from report import tree_identity  # noqa: E402

PHASE = "planner-shapes"
PORT = 8190
UTIL, CONTEXT = 0.90, 32768
# after the KV lines: the memory summary vLLM logs once its CUDA graphs are captured
GRACE_S = float(os.environ.get("LANE_GRACE_S", "10"))
STOP_RESERVE_S = 25.0
MEMORY_SUMMARY = re.compile(
    r"Actual usage is ([\d.]+) GiB for weight, ([\d.]+) GiB for peak activation, ([\d.]+) GiB "
    r"for non-torch memory, and ([\d.]+) GiB for CUDAGraph memory"
)
EXTRA = {
    "compile_range_max": r"compile range \(1, (\d+)\)",
    "cuda_graph_estimate_gib": r"Estimated CUDA graph memory: ([\d.]+) GiB",
    "graph_capture_gib": r"Graph capturing finished in [\d.]+ secs?, took ([\d.]+) GiB",
    "cuda_total_gib": r"Free memory on device \([\d.]+/([\d.]+) GiB\)",
}
RUNNER = re.compile(r"\[(\w+)\.py:\d+\] Model loading took")


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    flags: dict[str, Any] = field(default_factory=dict)
    cache: str = ""  # cases with the same cache share torch.compile's
    issue: int | None = None  # the KV tokens issue 25 recorded, for comparison
    need_s: float = 150.0  # a cold start to the KV line, at least


CASES = [
    Case("llama-3.1-8b-like", "llama-3.1-8b-like", issue=896_912, need_s=90),
    Case("qwen3-moe-30b-a3b-like", "qwen3-moe-30b-a3b-like", cache="moe", issue=714_128),
    Case(
        "qwen3-moe-30b-a3b-like-seqs20",
        "qwen3-moe-30b-a3b-like",
        {"max-num-seqs": 20},
        cache="moe",
        issue=739_888,
        need_s=70,
    ),
    Case("gemma-3-12b-like", "gemma-3-12b-like", cache="gemma", issue=452_218, need_s=120),
    # tells the planner's reading of the sliding-window reservation apart: window - 1 + 2 x
    # batched tokens (as measured) says 577 blocks a sliding group here, one step's worth 321
    Case(
        "gemma-3-12b-like-batched4096",
        "gemma-3-12b-like",
        {"max-num-batched-tokens": 4096},
        cache="gemma",
        need_s=70,
    ),
    # issue 40: DeepSeek-V2-Lite's public config (MLA: one 576-wide latent a token and layer,
    # 64-token blocks; 64 experts, 2 shared, the first layer dense) and gpt-oss-20b's unquantized
    # (24 layers alternating a 128-token sliding window with full attention, attention sinks,
    # 32 experts): the two kinds of attention the planner models but no run had checked
    Case("deepseek-v2-lite-like", "deepseek-v2-lite-like", cache="dsv2", need_s=100),
    Case("gpt-oss-20b-like", "gpt-oss-20b-like", cache="gptoss", need_s=100),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/lane-out"))
    p.add_argument("--work", type=Path, default=Path("/tmp/lane/planner-shapes"))
    p.add_argument("--tokenizer", type=Path, default=HERE / "tokenizer")
    p.add_argument("--budget-s", type=float, default=560)
    p.add_argument("--only", default="", help="comma-separated case names")
    return p.parse_args(argv)


def vllm_argv(model: Path, case: Case) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", case.name, "--host", "127.0.0.1", "--port", str(PORT),
            "--load-format", "dummy", "--gpu-memory-utilization", str(UTIL),
            "--max-model-len", str(CONTEXT)]  # fmt: skip
    for flag, value in case.flags.items():
        argv += [f"--{flag}", str(value)]
    return argv


def plan_argv(shape: Path, case: Case, gpu_gib: float) -> list[str]:
    argv = [sys.executable, "-m", "gpupool", "plan", "--model-config", str(shape),
            "--gpu-memory-gb", repr(gpu_gib), "--gpu-memory-utilization", str(UTIL),
            "--max-model-len", str(CONTEXT), "--json"]  # fmt: skip
    for flag, value in case.flags.items():
        argv += [f"--{flag}", str(value)]
    return argv


def planned(shape: Path, case: Case, gpu_gib: float) -> dict[str, Any]:
    """``gpupool plan`` of the repository copy (not the bundle's wheel, which may be older)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    data, errors = None, []
    for env in ({**os.environ, "PYTHONPATH": path}, dict(os.environ)):  # then the bundle's
        r = subprocess.run(plan_argv(shape, case, gpu_gib), capture_output=True, text=True,
                           timeout=120, env=env)  # fmt: skip
        try:
            data = json.loads(r.stdout)
            break
        except ValueError:
            errors.append((r.stdout + r.stderr)[-1500:])
    if data is None:
        return {"error": errors}
    mem, kv = data["memory_per_gpu"], data["kv_cache"]
    return {
        "kv_tokens": kv["tokens"],
        "kv_gib": round(mem["kv_budget_bytes"] / 2**30, 3),
        "max_concurrency": kv["max_concurrency"],
        "weights_gib": round(mem["weights_bytes"] / 2**30, 3),
        "overhead": {k: v for k, v in mem["overhead"].items() if v},
        "groups": kv["group_size"],
        "window_groups": kv.get("window_groups"),
        "blocks_per_request": kv["blocks_per_request"],
        "planner": "repository copy" if not errors else "bundle's gpupool",
    }


def launch(lane: Lane, case: Case, model: Path, cache: Path, log: Path) -> dict[str, Any]:
    """Start vLLM, wait for its KV lines (and the memory summary, briefly), stop it."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache), "CUDA_VISIBLE_DEVICES": "0"}
    deadline = time.monotonic() + max(30.0, lane.remaining() - STOP_RESERVE_S)
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(vllm_argv(model, case), stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # fmt: skip
    seen_kv: float | None = None
    outcome = "timeout"
    try:
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if seen_kv is None and "Maximum concurrency for" in text:
                seen_kv = time.monotonic()
                lane.say(f"  {case.name}: KV lines after {seen_kv - t0:.0f} s")
            if seen_kv is not None and (
                MEMORY_SUMMARY.search(text) or time.monotonic() - seen_kv > GRACE_S
            ):
                outcome = "ok"
                break
            if proc.poll() is not None:
                outcome = "ok" if seen_kv is not None else f"exited rc={proc.returncode}"
                break
            time.sleep(0.5)
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    return {
        "outcome": outcome,
        "to_kv_s": round(seen_kv - t0, 1) if seen_kv is not None else None,
        "figures": log_figures(text),
        "lines": lane_logs.key_lines(text, limit=30),
    }


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (API server and engine core), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def log_figures(text: str) -> dict[str, Any]:
    out = lane_logs.figures(text)
    for key, pattern in EXTRA.items():
        found = re.findall(pattern, text)
        if found:
            out[key] = float(found[-1])
    summary = MEMORY_SUMMARY.findall(text)
    if summary:
        keys = ("weights_gib", "peak_activation_gib", "non_torch_gib", "cuda_graph_gib")
        out["memory_summary"] = dict(zip(keys, map(float, summary[-1]), strict=True))
    runner = RUNNER.findall(text)
    if runner:
        out["runner"] = runner[-1]
    return out


def wait_gpu_free(baseline: int, timeout_s: float = 30.0) -> int:
    t0 = time.monotonic()
    used = lane_gpu.used_mib()
    while used and used[0] > baseline + 512 and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
        used = lane_gpu.used_mib()
    return used[0] if used else -1


def compare(case: Case, plan: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    f = got.get("figures", {})
    tokens, gib = f.get("kv_cache_tokens"), f.get("kv_cache_gib")
    conc = f.get("max_concurrency")
    row = {
        "kv_tokens_plan": plan.get("kv_tokens"),
        "kv_tokens_vllm": tokens,
        "kv_tokens_err_pct": err(plan.get("kv_tokens"), tokens),
        "kv_gib_plan": plan.get("kv_gib"),
        "kv_gib_vllm": gib,
        "kv_gib_err_pct": err(plan.get("kv_gib"), gib),
        "concurrency_plan": plan.get("max_concurrency"),
        "concurrency_vllm": conc[1] if isinstance(conc, list) else conc,
        "kv_tokens_issue25": case.issue,
    }
    known = [abs(e) for e in (row["kv_tokens_err_pct"], row["kv_gib_err_pct"]) if e is not None]
    row["within_2pct"] = bool(known) and max(known) <= 2.0
    return row


def err(plan: Any, logged: Any) -> float | None:
    if not isinstance(plan, int | float) or not isinstance(logged, int | float) or not logged:
        return None
    return pct(float(plan), float(logged))


def run_case(lane: Lane, case: Case, args: argparse.Namespace, gpu_gib: float, base: int) -> None:
    shape = HERE / "shapes" / case.shape
    work = args.work / case.name
    model = prepare_model(shape, args.tokenizer, work / "model")
    cache = args.work / "cache" / (case.cache or case.name)
    plan = planned(shape, case, gpu_gib)
    lane.say(f"case {case.name}: plan {plan.get('kv_tokens')} tokens; starting vLLM")
    got = launch(lane, case, model, cache, work / "vllm.log")
    free = wait_gpu_free(base)
    result = {"flags": case.flags, "plan": plan, **got, "gpu_used_mib_after": free}
    result["compare"] = compare(case, plan, got)
    c = result["compare"]
    lane.say(f"  {case.name}: vLLM {c['kv_tokens_vllm']} tokens, plan {c['kv_tokens_plan']} "
             f"({c['kv_tokens_err_pct']} %), {got['outcome']}")  # fmt: skip
    cases = lane.results.setdefault("cases", {})
    cases[case.name] = result
    lane.save()


def render(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    lines = [
        f"# Planner against vLLM on new shapes ({meta.get('date', '?')})",
        "",
        f"GPU: {meta.get('gpu')}; vLLM {meta.get('vllm')}; gpupool tree "
        f"{meta.get('gpupool_tree', {}).get('fingerprint', '?')[:12]}; "
        f"{UTIL} utilization, {CONTEXT} tokens.",
        "",
        "| case | vLLM tokens | planned | error | vLLM GiB | planned GiB | error | concurrency "
        "vLLM / plan | issue 25 | to KV line |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.get("cases", {}).items():
        c = r.get("compare", {})
        lines.append(
            f"| {name} | {c.get('kv_tokens_vllm')} | {c.get('kv_tokens_plan')} | "
            f"{c.get('kv_tokens_err_pct')} % | {c.get('kv_gib_vllm')} | {c.get('kv_gib_plan')} | "
            f"{c.get('kv_gib_err_pct')} % | {c.get('concurrency_vllm')} / "
            f"{c.get('concurrency_plan')} | {c.get('kv_tokens_issue25')} | {r.get('to_kv_s')} s |"
        )
    for name, why in results.get("not_run", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | | | | | |")
    lines += ["", "Per case, vLLM's own memory lines:", ""]
    for name, r in results.get("cases", {}).items():
        f = r.get("figures", {})
        keep = {k: f.get(k) for k in ("runner", "memory_summary", "compile_range_max",
                                      "cuda_graph_estimate_gib", "cuda_total_gib")}  # fmt: skip
        lines.append(f"- {name}: {json.dumps(keep)}")
    return "\n".join(lines) + "\n"


def write_logs(lane: Lane, args: argparse.Namespace) -> None:
    parts = [lane.log_path.read_text() if lane.log_path.exists() else ""]
    for name, r in lane.results.get("cases", {}).items():
        log = args.work / name / "vllm.log"
        tail = log.read_text(errors="replace").splitlines()[-60:] if log.exists() else []
        parts.append(f"\n===== {name}: key lines\n" + "\n".join(r.get("lines", [])))
        parts.append(f"===== {name}: last lines\n" + "\n".join(ln[:300] for ln in tail))
    lane.log_path.write_text("\n".join(parts)[-3 * 2**20 :])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    lane = Lane(PHASE, args.out, args.work, time.monotonic() + args.budget_s)
    lane.log_path.unlink(missing_ok=True)
    gpus = lane_gpu.gpus()
    if not gpus:
        lane.say("no GPU: nvidia-smi lists none")
        return 1
    gpu_gib = gpus[0]["memory_total_mib"] / 1024
    base = gpus[0]["memory_used_mib"]
    lane.put("meta", {
        "phase": PHASE,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": f"{gpus[0]['name']}, {gpus[0]['memory_total_mib']} MiB",
        "vllm": vllm_version(),
        "gpupool_tree": tree_identity(ROOT / "gpupool"),  # the planner measured
        "budget_s": args.budget_s,
    })  # fmt: skip
    only = {s for s in args.only.split(",") if s}
    not_run: dict[str, str] = {}
    for case in CASES:
        if only and case.name not in only:
            not_run[case.name] = "not selected (--only)"
        elif lane.remaining() - STOP_RESERVE_S < case.need_s:
            not_run[case.name] = f"out of time ({lane.remaining():.0f} s left)"
        else:
            try:
                run_case(lane, case, args, gpu_gib, base)
            except Exception as e:  # one case's failure must not lose the others
                lane.say(f"case {case.name} FAILED: {type(e).__name__}: {e}")
                not_run[case.name] = f"failed: {type(e).__name__}: {e}"
        lane.put("not_run", not_run)
    lane.put("elapsed_s", round(lane.elapsed(), 1))
    (args.out / f"report-{PHASE}.md").write_text(render(lane.results))
    write_logs(lane, args)
    return 0


def vllm_version() -> str:
    r = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    return r.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
