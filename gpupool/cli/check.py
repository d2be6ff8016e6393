"""``gpupool check``: the config is valid, its GPUs exist, and the seeds' pitfalls are named."""

from __future__ import annotations

import dataclasses

import click

from gpupool.config.models import GpupoolConfig
from gpupool.workers.gpus import discover_gpus
from gpupool.workers.planner.checks import check_gpu_sharing, check_launch_config


def run_check(cfg: GpupoolConfig, path: str) -> int:
    gpus = discover_gpus()
    findings = check_gpu_sharing(cfg.workers)
    for i, wc in enumerate(cfg.workers):
        if wc.launch is not None:
            for f in check_launch_config(wc.name, wc.launch, gpus, None):
                path = f.path.replace(f"workers[{wc.name}]", f"workers[{i}]")
                findings.append(dataclasses.replace(f, path=path))
    errors = [f for f in findings if f.level == "error"]
    for f in findings:
        colour = "red" if f.level == "error" else "yellow"
        click.secho(f"{f.level}: {f.path}: {f.message}", fg=colour, err=True)
    if errors:
        click.secho(f"{path}: {len(errors)} error(s)", fg="red", err=True)
        return 1
    n = len(cfg.workers)
    click.secho(f"{path}: OK ({len(cfg.models)} model(s), {n} worker(s))", fg="green")
    return 0
