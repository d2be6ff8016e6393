"""``gpupool sim``: run one simulated vLLM worker."""

from __future__ import annotations

from pathlib import Path

import click

from gpupool.workers.sim.config import (
    CHUNKINGS,
    MODES,
    REASONING_PARSERS,
    Chunking,
    GpuShape,
    Mode,
    ReasoningParserName,
    SimConfig,
)
from gpupool.workers.sim.sleep import sleep_options

EPILOG = """\b
Examples:
  gpupool sim --port 8001 --served-model-name qwen --max-model-len 32k \\
      --max-num-seqs 16 --ttft-ms 80 --itl-ms 20 --mode lorem --output-tokens 64
  gpupool sim --port 8002 --mode script --script '<think>a b</think>answer' \\
      --script-chunking chars --reasoning-parser qwen3
  gpupool sim --port 8003 --crash-after-tokens 5 --itl-ms 50   # dies mid-stream
  gpupool sim --port 8004 --gpu --max-num-seqs 128 --step-ms 15 --seq-step-ms 0.05 \\
      --prefill-ms-per-1k 8 --max-num-batched-tokens 8192   # continuous batching, GPU-shaped

\b
Control while it runs (tests):
  curl localhost:8001/sim/stats
  curl -XPOST localhost:8001/sim/control -d '{"fail_rate": 0.5, "hang": false}'
  curl -XPOST localhost:8001/sim/reset
"""


def _model_len(value: str) -> int:
    text = value.strip().lower()
    scale = 1024 if text.endswith("k") else 1
    try:
        return int(text.rstrip("k")) * scale
    except ValueError:
        raise click.BadParameter(f"not a length: {value!r} (use 4096 or 32k)") from None


def served_names(
    model: str | None, served_model_name: tuple[str, ...], root: str | None
) -> tuple[str, list[str], str]:
    """``(name, aliases, root)`` with vLLM's naming: with ``--served-model-name`` the names come
    from it and ``--model`` is the path on the card; with ``--model`` alone it is the name too."""
    names = list(served_model_name) or [model or "sim-model"]
    if served_model_name and model and not root:
        root = model
    return names[0], names[1:], root or ""


@click.command("sim", epilog=EPILOG, context_settings={"max_content_width": 100})
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default=None, help="Served name (or, with --served-model-name, the path).")
@click.option("--served-model-name", multiple=True, help="A served name; repeat for aliases.")
@click.option("--root", default=None, help="Model path shown on /v1/models [/models/NAME].")
@click.option("--max-model-len", default="4096", show_default=True, help="Context window; 32k ok.")
@click.option("--max-num-seqs", default=8, show_default=True, type=int, help="Concurrent runs.")
@click.option("--ttft-ms", default=0.0, show_default=True, type=float)
@click.option("--itl-ms", default=0.0, show_default=True, type=float)
@click.option("--mode", type=click.Choice(MODES), default="lorem", show_default=True)
@click.option("--script", default=None, help="Text emitted in script mode.")
@click.option("--script-file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option(
    "--script-chunking",
    type=click.Choice(CHUNKINGS),
    default="token",
    show_default=True,
    help="chars: seeded 1-3 character pieces.",
)
@click.option(
    "--output-tokens",
    default=16,
    show_default=True,
    type=int,
    help="Lorem length when max_tokens does not cut it.",
)
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default=None)
@click.option(
    "--startup-delay-s",
    default=0.0,
    show_default=True,
    type=float,
    help="Refuse connections this long, like a loading vLLM.",
)
@click.option(
    "--crash-after-tokens",
    default=None,
    type=int,
    help="os._exit(1) after a stream emitted this many tokens.",
)
@click.option(
    "--fail-rate",
    default=0.0,
    show_default=True,
    type=float,
    help="Fraction of requests answered 500.",
)
@click.option("--hang", is_flag=True, help="Never answer (health included).")
@click.option("--health-fail", is_flag=True, help="/health answers 503.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--load-format",
    default="auto",
    show_default=True,
    help="vLLM's; accepted as vLLM takes it (the simulator has no weights to load).",
)
@sleep_options  # --enable-sleep-mode and the sleep ledger (sleep.py)
@click.option(
    "--gpu",
    is_flag=True,
    help="GPU-shaped engine: continuous batching in steps (the options below; --ttft-ms and "
    "--itl-ms are then unused).",
)
@click.option(
    "--step-ms", default=20.0, show_default=True, type=float, help="--gpu: a step's base."
)
@click.option(
    "--seq-step-ms", default=0.5, show_default=True, type=float, help="--gpu: per sequence a step."
)
@click.option(
    "--tokens-per-step",
    default=1,
    show_default=True,
    type=int,
    help="--gpu: per decoding sequence.",
)
@click.option(
    "--prefill-ms-per-1k",
    default=10.0,
    show_default=True,
    type=float,
    help="--gpu: per 1,000 prompt tokens computed (prefix-cache hits are free).",
)
@click.option(
    "--max-num-batched-tokens",
    default=2048,
    show_default=True,
    type=int,
    help="--gpu: tokens a step computes (decodes 1 each, prompts chunked into the rest).",
)
@click.option(
    "--num-gpu-blocks-override",
    default=None,
    type=int,
    help="--gpu: KV cache blocks of 16 tokens [a full window per sequence].",
)
@click.option(
    "--kv-events-config",
    default=None,
    help="vLLM's KV-cache events JSON (endpoint, replay_endpoint, topic): publish the prefix "
    "cache's blocks as vLLM does (needs --tokenizer).",
)
@click.option(
    "--tokenizer",
    default=None,
    help="A model directory (tokenizer.json, chat template): prompts are tokenized and their "
    "blocks hashed as vLLM would, for --kv-events-config.",
)
def sim(
    host: str,
    port: int,
    model: str | None,
    served_model_name: tuple[str, ...],
    root: str | None,
    max_model_len: str,
    max_num_seqs: int,
    ttft_ms: float,
    itl_ms: float,
    mode: Mode,
    script: str | None,
    script_file: str | None,
    script_chunking: Chunking,
    output_tokens: int,
    reasoning_parser: ReasoningParserName | None,
    startup_delay_s: float,
    crash_after_tokens: int | None,
    fail_rate: float,
    hang: bool,
    health_fail: bool,
    seed: int,
    load_format: str,
    gpu: bool,
    step_ms: float,
    seq_step_ms: float,
    tokens_per_step: int,
    prefill_ms_per_1k: float,
    max_num_batched_tokens: int,
    num_gpu_blocks_override: int | None,
    kv_events_config: str | None,
    tokenizer: str | None,
) -> None:
    """Run a simulated vLLM 0.32 OpenAI server (no GPU, fault injection, /sim control)."""
    from gpupool.workers.sim.app import run_sim

    del load_format  # nothing to load

    if script_file is not None:
        script = Path(script_file).read_text(encoding="utf-8")
    if script is not None and not _mode_given():
        mode = "script"
    name, aliases, card_root = served_names(model, served_model_name, root)
    try:
        config = SimConfig(
            host=host,
            port=port,
            model=name,
            served_model_names=aliases,
            root=card_root,
            max_model_len=_model_len(max_model_len),
            max_num_seqs=max_num_seqs,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            mode=mode,
            script=script,
            script_chunking=script_chunking,
            output_tokens=output_tokens,
            reasoning_parser=reasoning_parser,
            startup_delay_s=startup_delay_s,
            crash_after_tokens=crash_after_tokens,
            fail_rate=fail_rate,
            hang=hang,
            health_fail=health_fail,
            seed=seed,
            gpu=GpuShape(
                step_ms=step_ms,
                seq_step_ms=seq_step_ms,
                tokens_per_step=tokens_per_step,
                prefill_ms_per_1k=prefill_ms_per_1k,
                max_num_batched_tokens=max_num_batched_tokens,
                num_gpu_blocks=num_gpu_blocks_override,
            )
            if gpu
            else None,
            kv_events_config=kv_events_config,
            tokenizer=tokenizer,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    run_sim(config)


def _mode_given() -> bool:
    ctx = click.get_current_context()
    return ctx.get_parameter_source("mode") is not click.core.ParameterSource.DEFAULT
