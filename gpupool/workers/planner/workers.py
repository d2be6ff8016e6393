"""Plans for every launched worker of a ``gpupool.yaml`` (``gpupool plan --config``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupool.config.models import GpupoolConfig, LaunchConfig, WorkerConfig
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.checks import (
    check_gpu_sharing,
    check_launch_config,
    launch_findings,
    launch_gpu_memory,
    launch_path,
)
from gpupool.workers.planner.errors import PlannerError
from gpupool.workers.planner.findings import Finding
from gpupool.workers.planner.launch_args import plan_args_from_launch
from gpupool.workers.planner.model_spec import ModelSpec, load_model_spec
from gpupool.workers.planner.plan import Plan
from gpupool.workers.planner.planning import plan_from_args

NO_GPU_MEMORY = (
    "GPU memory unknown: no NVIDIA GPU found (NVML not available) for its `gpus`; "
    "pass --gpu-memory-gb"
)


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    index: int
    name: str
    plan: Plan | None
    skipped: str | None  # why there is no plan
    findings: tuple[Finding, ...] = ()


def local_config_json(launch: LaunchConfig) -> Path | None:
    """``<model_path>/config.json`` when ``model_path`` is a local directory holding one."""
    path = Path(launch.model_path).expanduser() / "config.json"
    return path if path.is_file() else None


def load_worker_specs(
    config: GpupoolConfig, fallback: ModelSpec | None = None
) -> dict[str, ModelSpec | str]:
    """Each launched worker's spec, or the reason there is none (reads config.json files)."""
    out: dict[str, ModelSpec | str] = {}
    for w in config.workers:
        if w.launch is not None:
            out[w.name] = _worker_spec(w.launch, fallback)
    return out


def _worker_spec(launch: LaunchConfig, fallback: ModelSpec | None) -> ModelSpec | str:
    path = local_config_json(launch)
    if path is None:
        if fallback is not None:
            return fallback
        return (
            f"model config not available locally (`{launch.model_path}` is not a local "
            "directory with a config.json); pass --model-config"
        )
    try:
        return load_model_spec(path)
    except PlannerError as e:
        return str(e)


def plan_workers(
    config: GpupoolConfig,
    gpus: Sequence[GpuInfo],
    specs: Mapping[str, ModelSpec | str],
    *,
    gpu_memory_bytes: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    overhead_fraction: float | None = None,
) -> tuple[list[WorkerPlan], list[Finding]]:
    """One :class:`WorkerPlan` per launched worker, and the GPU-sharing findings."""
    plans: list[WorkerPlan] = []
    launched: list[WorkerConfig] = []
    for i, w in enumerate(config.workers):
        if w.launch is None:
            continue
        launch = w.launch.model_copy(update={"args": {**w.launch.args, **(overrides or {})}})
        launched.append(w.model_copy(update={"launch": launch}))
        spec = specs.get(w.name, "model config not available locally")
        plans.append(
            _worker_plan(i, w.name, launch, gpus, spec, gpu_memory_bytes, overhead_fraction)
        )
    return plans, check_gpu_sharing(launched)


def _worker_plan(
    index: int,
    name: str,
    launch: LaunchConfig,
    gpus: Sequence[GpuInfo],
    spec: ModelSpec | str,
    memory: int | None,
    overhead_fraction: float | None,
) -> WorkerPlan:
    prefix = launch_path(name, index)
    if not isinstance(spec, ModelSpec):
        findings = check_launch_config(name, launch, gpus, None, index=index)
        return WorkerPlan(index, name, None, spec, tuple(findings))
    base = [f.under(prefix) for f in launch_findings(launch, gpus, spec)]
    memory = memory or launch_gpu_memory(launch, gpus)
    if memory is None:
        findings = check_launch_config(name, launch, gpus, spec, index=index)
        return WorkerPlan(index, name, None, NO_GPU_MEMORY, tuple(findings))
    try:
        args = plan_args_from_launch(launch.args, memory, overhead_fraction=overhead_fraction)
        plan = plan_from_args(spec, args)
    except PlannerError as e:
        return WorkerPlan(index, name, None, str(e), tuple(base))
    planned = (*base, *(f.under(prefix) for f in plan.findings))
    return WorkerPlan(index, name, plan, None, planned)
