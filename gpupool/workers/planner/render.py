"""Plans, findings and GPUs as rich tables (for people) and plain dicts (for ``--json``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpupool.workers.gpus import GpuInfo, cache_key
from gpupool.workers.planner.findings import Finding, Level
from gpupool.workers.planner.kv_layout import KvLayout
from gpupool.workers.planner.memory import GiB, MiB, Overhead
from gpupool.workers.planner.plan import Plan
from gpupool.workers.planner.workers import WorkerPlan

NO_GPU = "No NVIDIA GPU found (NVML not available)"


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# --- JSON -------------------------------------------------------------------------------------


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "model": plan.model,
        "verdict": plan.verdict,
        "can_start": plan.can_start,
        "gpu": {
            "memory_bytes": plan.args.gpu_memory_bytes,
            "gpu_memory_utilization": plan.args.gpu_memory_utilization,
            "tensor_parallel_size": plan.tensor_parallel_size,
        },
        "settings": {
            "max_model_len": plan.max_model_len,
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "kv_cache_dtype": plan.kv_cache_dtype,
            "quantization": plan.quantization,
        },
        "memory_per_gpu": _memory_dict(plan),
        "kv_cache": _kv_dict(plan),
        "findings": [f.to_dict() for f in plan.findings],
    }


def _memory_dict(plan: Plan) -> dict[str, Any]:
    weights = plan.weights
    return {
        "budget_bytes": plan.budget_bytes,
        "weights_bytes": weights.total,
        "weights": {
            c.value: {"bytes": n, "precision": weights.precision[c]}
            for c, n in weights.by_component.items()
        },
        "overhead_bytes": plan.overhead.total,
        "overhead": _overhead_dict(plan.overhead),
        "kv_budget_bytes": plan.kv_budget_bytes,
        "outside_budget_bytes": plan.headroom_bytes,
    }


def _overhead_dict(o: Overhead) -> dict[str, Any]:
    return {
        "basis": o.basis,
        "activations_bytes": o.activations,
        "sampler_bytes": o.sampler,
        "cuda_graphs_bytes": o.cuda_graphs,
        "non_torch_bytes": o.non_torch,
        "backend_workspace_bytes": o.backend_workspace,
        "rule_of_thumb_bytes": o.rule_of_thumb,
    }


def _kv_dict(plan: Plan) -> dict[str, Any]:
    layout, cap = plan.layout, plan.capacity
    return {
        "bytes_per_token": plan.kv_bytes_per_token,
        "linear_state_bytes_per_sequence": plan.linear_state_bytes_per_seq,
        "hybrid": plan.hybrid,
        "block_size": layout.block_size,
        "page_bytes": layout.page_bytes,
        "group_size": layout.group_size,
        "attention_groups": layout.attention_groups,
        "mamba_groups": layout.mamba_groups,
        "window_groups": [
            {"groups": w.groups, "tokens": w.tokens, "kind": "chunked" if w.chunked else "sliding"}
            for w in layout.windows
        ],
        "num_blocks": cap.num_blocks,
        "blocks_per_request": cap.blocks_per_request,
        "max_concurrency": round(cap.max_concurrency, 4),
        "tokens": cap.tokens,
        "longest_fitting_max_model_len": plan.longest_fitting_len,
    }


def worker_plans_to_dict(plans: Sequence[WorkerPlan], shared: Sequence[Finding]) -> dict[str, Any]:
    workers = [
        {
            "index": w.index,
            "name": w.name,
            "plan": plan_to_dict(w.plan) if w.plan else None,
            "skipped": w.skipped,
            "model_source": w.model_source,
            "findings": [f.to_dict() for f in w.findings],
        }
        for w in plans
    ]
    return {"workers": workers, "findings": [f.to_dict() for f in shared]}


def gpu_to_dict(g: GpuInfo) -> dict[str, Any]:
    return {
        "index": g.index,
        "name": g.name,
        "memory_total_bytes": g.memory_total_bytes,
        "memory_free_bytes": g.memory_free_bytes,
        "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
        "cache_key": cache_key(g),
        "uuid": g.uuid,
    }


def gpus_to_dict(gpus: Sequence[GpuInfo]) -> dict[str, Any]:
    out: dict[str, Any] = {"gpus": [gpu_to_dict(g) for g in gpus]}
    if not gpus:
        out["message"] = NO_GPU
    return out


# --- rich -------------------------------------------------------------------------------------


def gpus_table(gpus: Sequence[GpuInfo]) -> Table:
    table = Table(title="NVIDIA GPUs (NVML)")
    for column in ("index", "name", "memory", "free", "compute capability", "cache key"):
        table.add_column(
            column, justify="right" if column in ("index", "memory", "free") else "left"
        )
    for g in gpus:
        major, minor = g.compute_capability
        table.add_row(
            str(g.index),
            g.name,
            gib(g.memory_total_bytes),
            gib(g.memory_free_bytes),
            f"{major}.{minor} ({g.sm})",
            cache_key(g),
        )
    return table


_VERDICT_STYLE = {"ok": "green", "ok, with warnings": "yellow", "cannot start": "bold red"}


def plan_table(plan: Plan) -> Table:
    a = plan.args
    title = Text.assemble(
        f"{plan.model}: ", (plan.verdict, _VERDICT_STYLE.get(plan.verdict, "")), " (per GPU)"
    )
    table = Table(title=title, show_header=True)
    table.add_column("")
    table.add_column("per GPU", justify="right")
    table.add_column("how")
    gpus = f"TP {a.tensor_parallel_size}, " if a.tensor_parallel_size > 1 else ""
    table.add_row(
        "budget",
        gib(plan.budget_bytes),
        f"{gpus}{gib(a.gpu_memory_bytes)} x gpu-memory-utilization {a.gpu_memory_utilization}",
    )
    table.add_row("weights", gib(plan.weights.total), _weights_how(plan))
    table.add_row("overhead", gib(plan.overhead.total), _overhead_how(plan.overhead))
    table.add_row("KV cache budget", gib(plan.kv_budget_bytes), "budget - weights - overhead")
    for row in _kv_rows(plan):
        table.add_row(*row)
    table.add_row(
        "outside budget", gib(plan.headroom_bytes), "total - budget - CUDA context (~0.5 GiB)"
    )
    return table


def _weights_how(plan: Plan) -> str:
    w = plan.weights
    parts = ", ".join(
        f"{c.value} {w.precision[c]} {n / GiB:.2f}"
        for c, n in sorted(w.by_component.items(), key=lambda kv: -kv[1])
        if n >= 0.01 * GiB
    )
    return f"{plan.quantization}: {parts}"


def _overhead_how(o: Overhead) -> str:
    if o.rule_of_thumb:
        text = f"{o.basis} (seed 001's rule of thumb)"
    else:
        text = (
            f"estimate: activations {o.activations / GiB:.2f}, sampler {o.sampler / GiB:.2f}, "
            f"CUDA graphs {o.cuda_graphs / GiB:.2f}, non-torch {o.non_torch / GiB:.2f}"
        )
    if o.backend_workspace:
        text += f", MoE backend workspace {o.backend_workspace / GiB:.2f} (seed 004)"
    return text


def _kv_rows(plan: Plan) -> list[tuple[str, str, str]]:
    layout, cap = plan.layout, plan.capacity
    full = f"full-attention layers, {plan.kv_cache_dtype}"
    rows = [("KV per token", f"{plan.kv_bytes_per_token:,} B", full)]
    if plan.hybrid:
        rows.append(
            (
                "linear state / seq",
                f"{plan.linear_state_bytes_per_seq / MiB:.1f} MiB",
                "Gated DeltaNet conv + recurrent state, all linear layers",
            )
        )
    how = "hybrid alignment (page >= GDN state)" if plan.hybrid else "vLLM default"
    rows += [
        (
            "block",
            f"{layout.block_size} tokens",
            f"{how}; {layout.groups} group(s) of "
            f"{layout.group_size} layers, {layout.block_bytes / MiB:.1f} MiB per block"
            + _windows_note(layout),
        ),
        ("KV cache", f"{cap.tokens:,} tokens", "as vLLM logs it: concurrency x max-model-len"),
        (
            "max concurrency",
            f"{cap.max_concurrency:.2f}",
            f"sequences of max-model-len {plan.max_model_len} ({cap.num_blocks} blocks, "
            f"{cap.blocks_per_request} per sequence); max-num-seqs {plan.max_num_seqs}",
        ),
        ("longest max-model-len", f"{plan.longest_fitting_len:,}", "one sequence alone"),
    ]
    return rows


_LEVEL_STYLE = {Level.error: "bold red", Level.warning: "yellow"}


def findings_text(findings: Sequence[Finding]) -> RenderableType:
    lines = [
        Text.assemble(
            (f.level.value, _LEVEL_STYLE[f.level]), f" {f.path}: " if f.path else " ", f.message
        )
        for f in findings
    ]
    return Group(*lines)


def worker_plan_renderables(w: WorkerPlan) -> list[RenderableType]:
    out: list[RenderableType] = [Text(f"workers[{w.index}] {w.name}", style="bold")]
    if w.model_source:
        out.append(Text(f"model shape from {w.model_source}", style="dim"))
    if w.plan is not None:
        out.append(plan_table(w.plan))
    else:
        out.append(Text(f"no plan: {w.skipped}", style="yellow"))
    if w.findings:
        out.append(findings_text(w.findings))
    return out


def _windows_note(layout: KvLayout) -> str:
    parts = [
        f"{w.groups} {'chunked' if w.chunked else 'sliding'} ({w.tokens:,}-token "
        f"{'chunk' if w.chunked else 'window'}: "
        f"{w.blocks(1 << 30, layout.block_size, layout.batched_tokens)} blocks a sequence at most)"
        for w in layout.windows
    ]
    return "; of them " + ", ".join(parts) if parts else ""
