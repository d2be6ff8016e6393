"""``gpupool check``: the config is valid, its GPUs exist, and the seeds' pitfalls are named."""

from __future__ import annotations

import click

from gpupool.config.models import GpupoolConfig
from gpupool.workers.gpus import discover_gpus
from gpupool.workers.planner import ModelSpec, PlannerError, check_config, load_worker_specs
from gpupool.workers.planner.gpu_catalog import machine_gpus
from gpupool.workers.planner.swap_checks import check_swap, host_ram, swap_notes


def run_check(
    cfg: GpupoolConfig,
    config_path: str,
    gpu_names: str | None = None,
    gpu_memory_gb: str | None = None,
) -> int:
    """Findings on stderr, a verdict on stdout; GPUs from ``--gpu``/``--gpu-memory-gb``, else
    NVML, else the config's ``gpus:`` section."""
    try:
        listed = bool(gpu_names or gpu_memory_gb)
        machine = machine_gpus(
            [] if listed else discover_gpus(), cfg.gpus, names=gpu_names, memory_gb=gpu_memory_gb
        )
    except PlannerError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        return 1
    gpus = machine.gpus
    loaded = load_worker_specs(cfg)
    specs: dict[str, ModelSpec | None] = {
        name: s for name, s in loaded.items() if not isinstance(s, str)
    }
    findings = check_config(cfg, gpus, specs)
    findings += check_swap(cfg, specs, host_ram())  # issue 28: sleep mode
    problems: list[str] = []  # launch-arg problems already failed the load
    for f in findings:
        colour = "red" if f.level == "error" else "yellow"
        click.secho(f"{f.level}: {f.path}: {f.message}", fg=colour, err=True)
    for p in problems:
        click.secho(f"error: {p}", fg="red", err=True)
    errors = len(problems) + sum(1 for f in findings if f.level == "error")
    if errors:
        click.secho(f"{config_path}: {errors} error(s)", fg="red", err=True)
        return 1
    n = len(cfg.workers)
    click.secho(f"{config_path}: OK ({len(cfg.models)} model(s), {n} worker(s))", fg="green")
    click.echo(f"GPUs from {machine.source}")
    for note in swap_notes(cfg):
        click.echo(f"note: {note}")
    return 0
