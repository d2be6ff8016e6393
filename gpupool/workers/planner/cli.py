"""``gpupool plan`` and ``gpupool gpus``: click commands the main group registers.

Transport only: parse options, call the planner, render. GPU discovery is injectable for tests
through ``obj=PlannerDeps(discover=...)`` (found with ``ctx.find_object``); without one, NVML.
Exit codes: 0 every plan can start, 1 a plan cannot start or an input is unusable, 2 usage.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from rich.console import Console

from gpupool.config.load import ConfigError, load_config
from gpupool.workers.gpus import GpuInfo, discover_gpus
from gpupool.workers.planner.errors import PlanArgsError, PlannerError
from gpupool.workers.planner.findings import Finding, has_errors
from gpupool.workers.planner.gpu_catalog import machine_gpus
from gpupool.workers.planner.launch_args import plan_args_from_launch
from gpupool.workers.planner.memory import GiB
from gpupool.workers.planner.model_spec import ModelSpec, load_model_spec
from gpupool.workers.planner.planning import plan_from_args
from gpupool.workers.planner.render import (
    NO_GPU,
    findings_text,
    gpus_table,
    gpus_to_dict,
    plan_table,
    plan_to_dict,
    worker_plan_renderables,
    worker_plans_to_dict,
)
from gpupool.workers.planner.resolve import resolve_model
from gpupool.workers.planner.workers import WorkerPlan, plan_workers, resolve_worker_models


@dataclass
class PlannerDeps:
    """What the commands need from the outside world."""

    discover: Callable[[], list[GpuInfo]] = discover_gpus


def _deps(ctx: click.Context) -> PlannerDeps:
    return ctx.find_object(PlannerDeps) or PlannerDeps()


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


GPUS_EPILOG = """\b
Examples:
  gpupool gpus
  gpupool gpus --json

The cache key (e.g. nvidia-blackwell-sm120) names the compile and Triton caches: GPUs with the
same compute capability share them, so a cache warmed on a 96 GB RTX PRO 6000 serves a 32 GB
RTX 5090.
"""


@click.command("gpus", epilog=GPUS_EPILOG)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def gpus(ctx: click.Context, as_json: bool) -> None:
    """List the NVIDIA GPUs NVML reports: index, name, memory, compute capability."""
    found = _deps(ctx).discover()
    if as_json:
        _echo_json(gpus_to_dict(found))
    elif not found:
        click.echo(NO_GPU)
    else:
        Console().print(gpus_table(found))


PLAN_EPILOG = """\b
Examples:
  # seed 000: Qwen3.5-35B-A3B AWQ on a 32 GB RTX 5090
  gpupool plan --model-config /models/Qwen3.5-35B-A3B-AWQ --gpu-memory-gb 31.8 \\
      --gpu-memory-utilization 0.83 --max-model-len 131072 --max-num-seqs 2 \\
      --kv-cache-dtype fp8 --max-num-batched-tokens 2096
  # seed 001: the 122B-A10B in FP8 on two H100s
  gpupool plan --model-config config.json --gpu-memory-gb 80 --quantization fp8 \\
      --tensor-parallel-size 2 --max-model-len 32768
  # a repo id: the HF cache, the Hub (config.json only) or a built-in shape
  gpupool plan --model Qwen/Qwen3.5-27B --gpu-memory-gb 79.2 --quantization fp8
  # every launched worker of a config: GPUs from NVML, else the config's `gpus:` section
  gpupool plan --config gpupool.yaml
  gpupool plan --config gpupool.yaml --gpu-memory-gb 32 --json
  # the cards behind GPU 0 and 1 on a machine without them (or their GiB: 95.6,31.8)
  gpupool plan --config config/examples/seed000-pro6000-5090.yaml --gpu "RTX PRO 6000,RTX 5090"

\b
All figures are per GPU. GiB throughout: --gpu-memory-gb is what nvidia-smi shows divided by
1024 (a "32 GB" RTX 5090 is 31.8, a "96 GB" RTX PRO 6000 is 95.6). Overhead is estimated from
the model's shapes; --overhead-fraction 0.15 uses the sizing guide's 15-20 % rule instead.
"""

_ARG_OPTIONS = (
    "quantization",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "moe_backend",
    "enforce_eager",
)


@click.command("plan", epilog=PLAN_EPILOG)
@click.option(
    "--model",
    "model_ref",
    help="A Hugging Face repo id or a model directory: its "
    "config.json from the HF cache, the Hub (config.json only) or a built-in shape.",
)
@click.option("--model-config", type=click.Path(exists=True),
              help="A model's config.json, or the directory holding it.")  # fmt: skip
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="Plan every launched worker of this gpupool.yaml.")  # fmt: skip
@click.option(
    "--gpu",
    "gpu_names",
    help="The cards behind GPU 0, 1, ... by name: "
    '"RTX PRO 6000,RTX 5090" or 2xH200 (default: NVML, else the config\'s `gpus:`).',
)
@click.option("--gpu-memory-gb", help="GiB of every GPU (one number), or of GPU 0, 1, ... "
              "(95.6,31.8 or 2x79.2). Default: NVML, else the config's `gpus:`.")  # fmt: skip
@click.option("--quantization", help="Weight format when config.json has none: fp8, int8, awq, "
              "gptq, int4, nvfp4, mxfp4.")  # fmt: skip
@click.option("--kv-cache-dtype", help="auto (model dtype), fp8, bfloat16, ...")
@click.option("--gpu-memory-utilization", type=float, help="vLLM's fraction (default 0.92).")
@click.option("--max-model-len", help="Context length; 32k, 32K, or -1 for the longest that fits.")
@click.option("--max-num-seqs", type=int, help="Concurrent sequences (vLLM default by GPU size).")
@click.option("--max-num-batched-tokens", type=int, help="Tokens per forward pass.")
@click.option("--tensor-parallel-size", type=int, help="GPUs per worker (default 1).")
@click.option("--moe-backend", help="e.g. marlin, flashinfer_b12x (seed 004).")
@click.option("--enforce-eager", is_flag=True, default=None, help="No CUDA graphs.")
@click.option("--overhead-fraction", type=float,
              help="Overhead as a fraction of the weights (seed 001: 0.15-0.20).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def plan(ctx: click.Context, /, **opts: Any) -> None:
    """Plan GPU memory for a vLLM worker: weights, overhead, KV cache, concurrency, verdict."""
    if not (opts["model_config"] or opts["config_path"] or opts["model_ref"]):
        raise click.UsageError("give --model, --model-config or --config")
    overrides = {k: opts[k] for k in _ARG_OPTIONS if opts[k] is not None}
    try:
        memory = _one_memory(opts["gpu_memory_gb"])
        if memory is not None:
            opts["gpu_memory_gb"] = None  # one size for every worker, not a list of GPUs
        if opts["config_path"]:
            ok = _plan_config(ctx, opts, overrides, memory)
        else:
            ok = _plan_model(ctx, opts, overrides, memory)
    except PlannerError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(0 if ok else 1)


def _plan_model(
    ctx: click.Context, opts: dict[str, Any], overrides: dict[str, Any], memory: int | None
) -> bool:
    if opts["model_config"]:
        spec = load_model_spec(opts["model_config"])
    else:
        resolved = resolve_model(opts["model_ref"])
        spec = resolved.spec
        if not opts["as_json"]:
            click.echo(f"model shape from {resolved.source}")
    if memory is None:
        memory = _listed_memory(opts, overrides) or _nvml_memory(ctx, overrides)
    args = plan_args_from_launch({}, memory, overrides, overhead_fraction=opts["overhead_fraction"])
    result = plan_from_args(spec, args)
    if opts["as_json"]:
        _echo_json(plan_to_dict(result))
    else:
        console = Console()
        console.print(plan_table(result))
        if result.findings:
            console.print(findings_text(result.findings))
    return result.can_start


def _one_memory(text: str | None) -> int | None:
    """``--gpu-memory-gb 32``: one size; ``95.6,31.8`` / ``2x80``: a list (None here)."""
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        return None
    if gib <= 0:
        raise PlanArgsError(f"--gpu-memory-gb: {gib} must be positive")
    return round(gib * GiB)


def _listed_memory(opts: dict[str, Any], overrides: dict[str, Any]) -> int | None:
    listed = machine_gpus([], names=opts["gpu_names"], memory_gb=opts["gpu_memory_gb"]).gpus
    tp = int(overrides.get("tensor_parallel_size") or 1)
    return min(g.memory_total_bytes for g in listed[:tp]) if listed else None


def _nvml_memory(ctx: click.Context, overrides: dict[str, Any]) -> int:
    found = _deps(ctx).discover()
    if not found:
        raise click.ClickException(f"{NO_GPU}; pass --gpu or --gpu-memory-gb")
    tp = int(overrides.get("tensor_parallel_size") or 1)
    return min(g.memory_total_bytes for g in found[:tp])


def _plan_config(
    ctx: click.Context, opts: dict[str, Any], overrides: dict[str, Any], memory: int | None
) -> bool:
    try:
        config = load_config(opts["config_path"])
    except ConfigError as e:
        raise click.ClickException(f"invalid configuration {opts['config_path']}:\n{e}") from None
    fallback: ModelSpec | None = None
    if opts["model_config"]:
        fallback = load_model_spec(opts["model_config"])
    specs = resolve_worker_models(config, fallback)
    discovered = [] if opts["gpu_names"] or opts["gpu_memory_gb"] else _deps(ctx).discover()
    machine = machine_gpus(
        discovered, config.gpus, names=opts["gpu_names"], memory_gb=opts["gpu_memory_gb"]
    )
    plans, shared = plan_workers(
        config,
        machine.gpus,
        specs,
        gpu_memory_bytes=memory,
        overrides=overrides,
        overhead_fraction=opts["overhead_fraction"],
    )
    if opts["as_json"]:
        _echo_json({**worker_plans_to_dict(plans, shared), "gpus_from": machine.source})
    else:
        click.echo(f"GPUs from {machine.source}")
        _print_workers(plans, shared)
    return not has_errors([*shared, *(f for p in plans for f in p.findings)])


def _print_workers(plans: list[WorkerPlan], shared: list[Finding]) -> None:
    console = Console()
    if not plans:
        console.print("No launched workers (only `url:` workers) in this configuration.")
    for p in plans:
        for item in worker_plan_renderables(p):
            console.print(item)
    if shared:
        console.print(findings_text(shared))
