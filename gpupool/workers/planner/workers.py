"""Plans for every launched worker of a ``gpupool.yaml`` (``gpupool plan --config``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpupool.config.models import GpupoolConfig, LaunchConfig, WorkerConfig
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.checks import (
    check_gpu_sharing,
    check_launch_config,
    launch_findings,
    launch_gpu_memory,
    launch_path,
    warmed_workers,
)
from gpupool.workers.planner.errors import PlannerError
from gpupool.workers.planner.findings import Finding
from gpupool.workers.planner.launch_args import plan_args_from_launch
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.plan import Plan
from gpupool.workers.planner.planning import plan_from_args
from gpupool.workers.planner.resolve import HubFiles, ResolvedModel, resolve_model

NO_GPU_MEMORY = (
    "GPU memory unknown: no NVIDIA GPU found (NVML not available) for its `gpus`; "
    "name the cards in the config's `gpus:` section, or pass --gpu or --gpu-memory-gb"
)


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    index: int
    name: str
    plan: Plan | None
    skipped: str | None  # why there is no plan
    findings: tuple[Finding, ...] = ()
    model_source: str | None = None  # where the model's shape came from


def load_worker_specs(
    config: GpupoolConfig, fallback: ModelSpec | None = None, *, hub: HubFiles | None = None
) -> dict[str, ModelSpec | str]:
    """Each launched worker's spec, or the reason there is none."""
    resolved = resolve_worker_models(config, fallback, hub=hub)
    return {k: v.spec if isinstance(v, ResolvedModel) else v for k, v in resolved.items()}


def resolve_worker_models(
    config: GpupoolConfig, fallback: ModelSpec | None = None, *, hub: HubFiles | None = None
) -> dict[str, ResolvedModel | str]:
    """Each launched worker's model (``fallback`` wins when given), or why there is none.

    The worker's ``model_path`` is resolved like vLLM does (local path, Hugging Face cache, the
    Hub's config.json); its served ``model`` name helps find a built-in shape."""
    out: dict[str, ResolvedModel | str] = {}
    found: dict[tuple[str, str], ResolvedModel | str] = {}
    for w in config.workers:
        if w.launch is None:
            continue
        if fallback is not None:
            out[w.name] = ResolvedModel(fallback, "--model-config")
            continue
        key = (w.launch.model_path, w.model)
        if key not in found:
            found[key] = _resolve(w.launch, w.model, hub)
        out[w.name] = found[key]
    return out


def _resolve(launch: LaunchConfig, served: str, hub: HubFiles | None) -> ResolvedModel | str:
    try:
        return resolve_model(launch.model_path, hint=served, hub=hub)
    except PlannerError as e:
        return str(e)


def plan_workers(
    config: GpupoolConfig,
    gpus: Sequence[GpuInfo],
    specs: Mapping[str, ModelSpec | ResolvedModel | str],
    *,
    gpu_memory_bytes: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    overhead_fraction: float | None = None,
) -> tuple[list[WorkerPlan], list[Finding]]:
    """One :class:`WorkerPlan` per launched worker, and the GPU-sharing findings."""
    plans: list[WorkerPlan] = []
    launched: list[WorkerConfig] = []
    warmed = warmed_workers(config, gpus)
    for i, w in enumerate(config.workers):
        if w.launch is None:
            continue
        launch = w.launch.model_copy(update={"args": {**w.launch.args, **(overrides or {})}})
        launched.append(w.model_copy(update={"launch": launch}))
        spec = specs.get(w.name, "model config not available")
        source = spec.source if isinstance(spec, ResolvedModel) else None
        if isinstance(spec, ResolvedModel):
            spec = spec.spec
        made = _worker_plan(
            i,
            w.name,
            launch,
            gpus,
            spec,
            gpu_memory_bytes,
            overhead_fraction,
            warmed=w.name in warmed,
        )
        plans.append(replace(made, model_source=source))
    return plans, check_gpu_sharing(launched)


def _worker_plan(
    index: int,
    name: str,
    launch: LaunchConfig,
    gpus: Sequence[GpuInfo],
    spec: ModelSpec | str,
    memory: int | None,
    overhead_fraction: float | None,
    *,
    warmed: bool = False,
) -> WorkerPlan:
    prefix = launch_path(name, index)
    if not isinstance(spec, ModelSpec):
        findings = check_launch_config(name, launch, gpus, None, index=index)
        return WorkerPlan(index, name, None, spec, tuple(findings))
    base = [f.under(prefix) for f in launch_findings(launch, gpus, spec)]
    memory = memory or launch_gpu_memory(launch, gpus)
    if memory is None:
        findings = check_launch_config(name, launch, gpus, spec, index=index, warmed=warmed)
        return WorkerPlan(index, name, None, NO_GPU_MEMORY, tuple(findings))
    try:
        args = plan_args_from_launch(
            launch.args, memory, overhead_fraction=overhead_fraction, triton_cache_warmed=warmed
        )
        plan = plan_from_args(spec, args)
    except PlannerError as e:
        return WorkerPlan(index, name, None, str(e), tuple(base))
    planned = (*base, *(f.under(prefix) for f in plan.findings))
    return WorkerPlan(index, name, plan, None, planned)
