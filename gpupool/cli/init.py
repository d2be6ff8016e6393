"""``gpupool init``: detect the GPUs, ask what is wanted, write a commented ``gpupool.yaml``.

Transport only: options (or, in a terminal, questions with defaults) → :func:`plan_pool` →
:func:`render_pool`; the written file is loaded and checked before it is kept. GPU discovery
is injectable like ``gpupool plan``'s (``obj=PlannerDeps(discover=...)``).
Exit codes: 0 written, 1 refused (the model cannot fit as asked) or unusable input, 2 usage.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
import yaml

from gpupool.config.load import ConfigError, parse_config
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.checks import check_config
from gpupool.workers.planner.cli import PlannerDeps
from gpupool.workers.planner.errors import PlannerError
from gpupool.workers.planner.findings import Level
from gpupool.workers.planner.gpu_catalog import gpus_from_memory, gpus_from_names
from gpupool.workers.planner.init_layout import InitRequest, PoolLayout, plan_pool
from gpupool.workers.planner.init_yaml import render_pool
from gpupool.workers.planner.launch_args import human_int
from gpupool.workers.planner.resolve import ResolvedModel, resolve_model

EPILOG = """\b
Examples:
  gpupool init --model Qwen/Qwen3.5-27B-FP8
  # seed 000's workstation, planned without the GPUs at hand
  gpupool init --model cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit --gpu "RTX PRO 6000,RTX 5090" \\
      --context 131072 -o gpupool.yaml
  gpupool init --model Qwen/Qwen3.5-397B-A17B-FP8 --gpu 8xH200 --concurrency 32
  gpupool init --model /models/my-model --gpu-memory-gb 2x79.2 --text-only

\b
Then: gpupool check --config gpupool.yaml && gpupool serve --config gpupool.yaml
In a terminal, what is not given is asked, with defaults. The model's config.json is read from
the directory, the Hugging Face cache or the Hub (config.json only); offline, a built-in shape
of the Qwen3.5/3.6 family is used and said so.
"""


@click.command("init", epilog=EPILOG)
@click.option("--model", "model_ref", help="Hugging Face repo id or model directory.")
@click.option("--gpu", "gpu_names", help='GPUs by name instead of NVML: "RTX 5090,RTX PRO 6000", '
              '"8xH200".')  # fmt: skip
@click.option("--gpu-memory-gb", help='GPUs by memory (GiB) instead of NVML: "80,80", "2x79.2".')
@click.option("--context", help="Context length wanted (max-model-len): 131072, 128K, 32k.")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Sequences each worker should run at once (default: what its KV cache holds "
              "at full context).")  # fmt: skip
@click.option("--multimodal/--text-only", default=None,
              help="Accept images (default: yes when the model has a vision tower).")  # fmt: skip
@click.option("--images", type=click.IntRange(min=0), default=2, show_default=True,
              help="Images per prompt.")  # fmt: skip
@click.option("--videos", type=click.IntRange(min=0), default=0, show_default=True,
              help="Videos per prompt.")  # fmt: skip
@click.option("--quantization", help="Quantize a bf16 checkpoint online (fp8).")
@click.option("--kv-cache-dtype", help="Force the KV cache dtype (default: chosen).")
@click.option("--port", type=int, default=8000, show_default=True, help="The gateway's port.")
@click.option("-o", "--output", default="gpupool.yaml", show_default=True,
              help="Where to write; - for stdout.")  # fmt: skip
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
@click.pass_context
def init(ctx: click.Context, /, **opts: Any) -> None:
    """Write a gpupool.yaml for this host: one worker per GPU (or tensor-parallel group), every
    vLLM flag chosen by the planner and explained in a comment."""
    interactive = _interactive(opts["output"])
    if interactive:
        _ask(opts)
    if not opts["model_ref"]:
        raise click.UsageError("give --model (a Hugging Face repo id or a model directory)")
    out = Path(opts["output"])
    if opts["output"] != "-" and out.exists() and not opts["force"]:
        raise click.ClickException(f"{out} exists; pass --force to overwrite it")
    try:
        gpus = _gpus(ctx, opts)
        model = resolve_model(opts["model_ref"])
        if interactive:
            _ask_wants(opts, model)
        layout = plan_pool(model, gpus, _request(opts))
        text = render_pool(layout, port=opts["port"])
        _self_check(text, gpus, model)
    except PlannerError as e:
        raise click.ClickException(str(e)) from None
    _write(text, opts["output"])
    if opts["output"] != "-":
        _summary(layout, opts["output"])


def _interactive(output: str) -> bool:
    """Questions only for a person at a terminal, and not when the file goes to stdout."""
    return sys.stdin.isatty() and output != "-"


def _ask(opts: dict[str, Any]) -> None:
    if not opts["model_ref"]:
        opts["model_ref"] = click.prompt("Model (Hugging Face repo id or directory)")


def _ask_wants(opts: dict[str, Any], model: ResolvedModel) -> None:
    spec = model.spec
    if opts["context"] is None:
        limit = spec.max_position_embeddings or 131072
        opts["context"] = click.prompt("Context length (tokens)", default=str(min(limit, 131072)))
    if opts["concurrency"] is None:
        answer = click.prompt("Sequences per worker (auto: what the KV cache holds)",
                              default="auto")  # fmt: skip
        opts["concurrency"] = None if answer == "auto" else int(answer)
    if opts["multimodal"] is None and spec.vision is not None:
        opts["multimodal"] = click.confirm("Accept images?", default=True)


def _gpus(ctx: click.Context, opts: dict[str, Any]) -> list[GpuInfo]:
    if opts["gpu_names"]:
        return gpus_from_names(opts["gpu_names"])
    if opts["gpu_memory_gb"]:
        return gpus_from_memory(opts["gpu_memory_gb"])
    found = (ctx.find_object(PlannerDeps) or PlannerDeps()).discover()
    if not found:
        raise click.ClickException(
            'no NVIDIA GPU found (NVML); name them: --gpu "RTX 5090,RTX PRO 6000" or '
            '--gpu-memory-gb "80,80"'
        )
    return found


def _request(opts: dict[str, Any]) -> InitRequest:
    context = opts["context"]
    return InitRequest(
        model=opts["model_ref"],
        context=None if context in (None, "", "auto") else human_int(context, "--context"),
        concurrency=opts["concurrency"],
        multimodal=opts["multimodal"],
        images=opts["images"],
        videos=opts["videos"],
        quantization=opts["quantization"],
        kv_cache_dtype=opts["kv_cache_dtype"],
    )


def _self_check(text: str, gpus: list[GpuInfo], model: ResolvedModel) -> None:
    """The file must load and pass the same checks ``gpupool check`` runs."""
    try:
        config = parse_config(yaml.safe_load(text))
    except ConfigError as e:
        raise PlannerError("internal error: the written config does not load: " + str(e)) from e
    specs = {w.name: model.spec for w in config.workers}
    errors = [f for f in check_config(config, gpus, specs) if f.level is Level.error]
    if errors:
        lines = "; ".join(f"{f.path}: {f.message}" for f in errors)
        raise PlannerError(f"internal error: the written config fails its checks: {lines}")


def _write(text: str, output: str) -> None:
    if output == "-":
        click.echo(text, nl=False)
        return
    Path(output).write_text(text, encoding="utf-8")


def _summary(layout: PoolLayout, output: str) -> None:
    click.echo(f"wrote {output}: {layout.model.spec.name}, model shape from {layout.model.source}")
    for w in layout.workers:
        p = w.flags.plan
        gpus = ",".join(str(g.index) for g in w.flags.target.gpus)
        click.echo(
            f"  {w.name}: GPU {gpus}, max-model-len {p.max_model_len}, max-num-seqs "
            f"{p.max_num_seqs}, kv {p.kv_cache_dtype}, utilization {p.args.gpu_memory_utilization}"
        )
    for reason in layout.left_out:
        click.echo(f"  left out: {reason}")
    click.echo(f"next: gpupool check --config {output} && gpupool serve --config {output}")
