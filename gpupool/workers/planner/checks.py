"""Configuration checks for ``gpupool check``: pure functions from config to findings.

- :func:`check_launch_config`: one launched worker against the discovered GPUs and, when its
  ``config.json`` is at hand, the full memory plan (cannot-start errors, the seeds' warnings).
- :func:`check_gpu_sharing`: workers pinned to the same GPU whose gpu-memory-utilization
  fractions add up to more than the card.
- :func:`check_config`: both, over a whole :class:`GpupoolConfig`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool.config.models import GpupoolConfig, LaunchConfig, WorkerConfig
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.dtypes import kv_cache_bytes
from gpupool.workers.planner.errors import PlannerError
from gpupool.workers.planner.findings import Finding, error, has_errors, warning
from gpupool.workers.planner.launch_args import (
    normalize_args,
    plan_args_from_launch,
    tensor_parallel_size,
    utilization,
)
from gpupool.workers.planner.memory import GiB, model_precision
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.plan import PlanArgs
from gpupool.workers.planner.planning import kv_layout_for, plan_from_args
from gpupool.workers.planner.quant import QuantScheme, requested_scheme, resolve_scheme
from gpupool.workers.planner.verdicts import batched_tokens_findings, tp_findings

SHARING_MARGIN = 0.05
"""Left over on a shared GPU below which a warning is given: each vLLM also holds a CUDA
context outside its fraction, and vLLM checks at startup that its whole fraction is free."""


def launch_gpus(launch: LaunchConfig, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The discovered GPUs a launch runs on: its ``gpus``, else the first TP-size ones."""
    if launch.gpus is not None:
        by_index = {g.index: g for g in gpus}
        return [by_index[i] for i in launch.gpus if i in by_index]
    try:
        tp = tensor_parallel_size(normalize_args(launch.args))
    except PlannerError:
        tp = 1
    return list(gpus[:tp])


def launch_gpu_memory(launch: LaunchConfig, gpus: Sequence[GpuInfo]) -> int | None:
    """The smallest total memory among the launch's GPUs (it bounds every TP rank)."""
    selected = launch_gpus(launch, gpus)
    return min(g.memory_total_bytes for g in selected) if selected else None


def check_launch_config(
    worker_name: str,
    launch: LaunchConfig,
    gpus: Sequence[GpuInfo],
    spec: ModelSpec | None,
    *,
    index: int | None = None,
    gpu_memory_bytes: int | None = None,
    warmed: bool = False,
) -> list[Finding]:
    """Findings for one launched worker, with paths under ``workers[<index>].launch``
    (``workers[<name>]`` when no index is given). ``gpu_memory_bytes`` overrides NVML;
    ``warmed``: a larger card fills its Triton cache first (:func:`warmed_workers`).

    With a spec and GPU memory (discovered or given) this includes the memory plan's verdicts;
    with a spec alone, what needs no memory (head divisibility, the hybrid block size)."""
    findings = launch_findings(launch, gpus, spec)
    if spec is not None and not has_errors(findings):
        findings += _spec_findings(launch, gpus, spec, gpu_memory_bytes, warmed)
    return [f.under(launch_path(worker_name, index)) for f in findings]


def launch_path(worker_name: str, index: int | None) -> str:
    return f"workers[{index if index is not None else worker_name}].launch"


def launch_findings(
    launch: LaunchConfig, gpus: Sequence[GpuInfo], spec: ModelSpec | None
) -> list[Finding]:
    """What is wrong with a launch besides its memory plan (paths relative to ``launch``)."""
    findings = _index_findings(launch, gpus)
    try:
        args = normalize_args(launch.args)
        util = utilization(args)
        tp = tensor_parallel_size(args)
    except PlannerError as e:
        return [*findings, error("args", str(e))]
    if not 0 < util <= 1:
        return [*findings, error("args.gpu-memory-utilization", f"must be in (0, 1], got {util}")]
    selected = launch_gpus(launch, gpus)
    findings += _tp_count_findings(launch, tp)
    findings += _arch_findings(selected, _scheme(spec, args.get("quantization")))
    return findings + _mixed_gpu_findings(selected)


def _spec_findings(
    launch: LaunchConfig,
    gpus: Sequence[GpuInfo],
    spec: ModelSpec,
    memory: int | None,
    warmed: bool,
) -> list[Finding]:
    memory = memory or launch_gpu_memory(launch, gpus)
    try:
        plan_args = plan_args_from_launch(launch.args, memory or 1, triton_cache_warmed=warmed)
        if memory is None:
            return _static_findings(spec, plan_args)
        return list(plan_from_args(spec, plan_args).findings)
    except PlannerError as e:
        return [error("args", str(e))]


def _index_findings(launch: LaunchConfig, gpus: Sequence[GpuInfo]) -> list[Finding]:
    if launch.gpus is None:
        return []
    out: list[Finding] = []
    if len(set(launch.gpus)) != len(launch.gpus):
        out.append(error("gpus", f"lists a GPU twice: {launch.gpus}"))
    known = {g.index for g in gpus}
    missing = [i for i in launch.gpus if i not in known]
    if gpus and missing:
        have = ", ".join(str(i) for i in sorted(known))
        out.append(error("gpus", f"GPU {missing} does not exist on this host (found: {have})"))
    return out


def _tp_count_findings(launch: LaunchConfig, tp: int) -> list[Finding]:
    if launch.gpus is None:
        return []
    n = len(launch.gpus)
    if n < tp:
        return [
            error(
                "args.tensor-parallel-size",
                f"tensor-parallel-size {tp} needs {tp} GPUs but `gpus` lists {n}",
            )
        ]
    if n > tp:
        unused = launch.gpus[tp:]
        return [warning("gpus", f"lists {n} GPUs for tensor-parallel-size {tp}: {unused} idle")]
    return []


def _scheme(spec: ModelSpec | None, requested: Any) -> QuantScheme | None:
    req = None if requested is None else str(requested)
    try:
        return resolve_scheme(spec, req)[0] if spec is not None else requested_scheme(req)
    except PlannerError:
        return None


def _arch_findings(selected: Sequence[GpuInfo], scheme: QuantScheme | None) -> list[Finding]:
    if scheme is None or not selected:
        return []
    kinds = {p.name for p in (scheme.precision, *scheme.overrides.values()) if p}
    oldest = min(selected, key=lambda g: g.compute_capability)
    cc = oldest.compute_capability
    where = f"GPU {oldest.index} ({oldest.name}, compute capability {cc[0]}.{cc[1]})"
    out: list[Finding] = []
    if "fp8" in kinds and cc < (8, 9):
        out.append(
            warning(
                "args.quantization",
                f"fp8 weights on {where}: no FP8 tensor cores before Ada/Hopper (8.9); vLLM "
                "errors or falls back to a slower path; use int8 on A100 (seed 001)",
            )
        )
    if "nvfp4" in kinds and cc < (10, 0):
        out.append(
            warning(
                "args.quantization",
                f"NVFP4 weights on {where}: FP4 tensor cores need Blackwell (10.0+) (seed 002)",
            )
        )
    return out


def _mixed_gpu_findings(selected: Sequence[GpuInfo]) -> list[Finding]:
    sizes = {g.memory_total_bytes for g in selected}
    if len(sizes) < 2:
        return []
    smallest = min(selected, key=lambda g: g.memory_total_bytes)
    message = (
        f"tensor-parallel ranks on GPUs of different memory: every rank gets the KV cache of the "
        f"smallest, GPU {smallest.index} ({smallest.memory_total_bytes / GiB:.1f} GiB)"
    )
    return [warning("gpus", message)]


def _static_findings(spec: ModelSpec, args: PlanArgs) -> list[Finding]:
    """What can be said without GPU memory: head divisibility and the hybrid block size."""
    out = tp_findings(spec, args.tensor_parallel_size)
    if not spec.is_hybrid or args.max_num_batched_tokens is None:
        return out
    _, kv_bytes = kv_cache_bytes(args.kv_cache_dtype, model_precision(spec).name)
    layout = kv_layout_for(spec, kv_bytes, args)
    if args.enable_prefix_caching:
        out += batched_tokens_findings(
            layout.block_size, args.max_num_batched_tokens, layout.mamba_page_bytes
        )
    return out


@dataclass(frozen=True, slots=True)
class _Share:
    index: int
    name: str
    fraction: float
    group: str | None = None  # a swap group's members count once (the largest)


def check_gpu_sharing(workers: Sequence[WorkerConfig]) -> list[Finding]:
    """Errors when workers pinned to one GPU ask for more than all of it together. The members
    of a swap group take turns (one awake at a time): together they count as their largest."""
    by_gpu: dict[int, list[_Share]] = defaultdict(list)
    for i, w in enumerate(workers):
        if w.launch is None or w.launch.gpus is None:
            continue
        try:
            fraction = utilization(normalize_args(w.launch.args))
        except PlannerError:
            continue  # reported by check_launch_config
        for gpu in set(w.launch.gpus):
            shares = by_gpu[gpu]
            turn = next((s for s in shares if w.swap_group and s.group == w.swap_group), None)
            if turn is None:
                shares.append(_Share(i, w.name, fraction, w.swap_group))
            elif fraction > turn.fraction:
                shares[shares.index(turn)] = _Share(i, w.name, fraction, w.swap_group)
    return [f for gpu, shares in sorted(by_gpu.items()) if (f := _sharing_finding(gpu, shares))]


def _sharing_finding(gpu: int, shares: list[_Share]) -> Finding | None:
    total = sum(s.fraction for s in shares)
    if len(shares) < 2 or total <= 1 - SHARING_MARGIN:
        return None
    parts = ", ".join(f"{s.name} ({s.fraction})" for s in shares)
    path = f"workers[{shares[-1].index}].launch.args.gpu-memory-utilization"
    if total > 1:
        message = (
            f"GPU {gpu} is shared by {parts}: gpu-memory-utilization fractions sum to "
            f"{total:.2f} > 1; vLLM checks at startup that its fraction is free, so the later "
            "worker cannot start (vLLM's default is 0.92 when unset)"
        )
        return error(path, message)
    message = (
        f"GPU {gpu} is shared by {parts}: fractions sum to {total:.2f}, leaving less than "
        f"{SHARING_MARGIN:.0%} for the CUDA contexts (~0.5 GiB each) and Triton autotuning"
    )
    return warning(path, message)


def check_config(
    config: GpupoolConfig,
    gpus: Sequence[GpuInfo],
    specs: Mapping[str, ModelSpec | None],
    *,
    gpu_memory_bytes: int | None = None,
) -> list[Finding]:
    """Every launched worker (``specs`` by worker name) plus GPU sharing."""
    findings: list[Finding] = []
    warmed = warmed_workers(config, gpus)
    for i, w in enumerate(config.workers):
        if w.launch is not None:
            spec = specs.get(w.name)
            findings += check_launch_config(
                w.name,
                w.launch,
                gpus,
                spec,
                index=i,
                gpu_memory_bytes=gpu_memory_bytes,
                warmed=w.name in warmed,
            )
    return findings + check_gpu_sharing(config.workers)


def warmed_workers(config: GpupoolConfig, gpus: Sequence[GpuInfo]) -> set[str]:
    """Workers that start after a worker with a warm-up list on GPUs of the same compute
    capability (seed 000): they share its Triton cache, filled before they launch. When NVML
    found no GPU the architecture cannot be compared and ``start_after`` is trusted."""
    by_name = {w.name: w for w in config.workers}
    out: set[str] = set()
    for w in config.workers:
        if w.launch is None:
            continue
        arch = _archs(w.launch, gpus)
        for dep in (by_name[n] for n in w.launch.start_after if n in by_name):
            if dep.warmup and dep.launch is not None and _archs(dep.launch, gpus) == arch:
                out.add(w.name)
    return out


def _archs(launch: LaunchConfig, gpus: Sequence[GpuInfo]) -> set[tuple[int, int]]:
    return {g.compute_capability for g in launch_gpus(launch, gpus)}
