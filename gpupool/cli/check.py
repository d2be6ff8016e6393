"""``gpupool check``: the config is valid, its GPUs exist, and the seeds' pitfalls are named."""

from __future__ import annotations

import click

from gpupool.config.models import GpupoolConfig
from gpupool.workers.gpus import discover_gpus
from gpupool.workers.planner import ModelSpec, check_config, load_worker_specs


def run_check(cfg: GpupoolConfig, config_path: str) -> int:
    gpus = discover_gpus()
    loaded = load_worker_specs(cfg)
    specs: dict[str, ModelSpec | None] = {
        name: s for name, s in loaded.items() if not isinstance(s, str)
    }
    findings = check_config(cfg, gpus, specs)
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
    return 0
