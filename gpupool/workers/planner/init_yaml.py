"""Write a :class:`PoolLayout` as a commented ``gpupool.yaml``: every choice says why.

Values are written as JSON scalars and flow mappings (valid YAML), so the file loads exactly as
written; ``gpupool check`` runs on it in the tests.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from gpupool.workers.planner.init_layout import PoolLayout, WorkerLayout
from gpupool.workers.planner.memory import GiB

WIDTH = 98
STARTUP_TIMEOUT_S = 1800
WARMUP_TEXT = (
    ("Write one sentence about GPUs.", 32),
    ("Summarise the history of computing in three paragraphs.", 256),
)
WARMUP_IMAGES = ((64, 64), (256, 256), (512, 512))


class _Doc:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def comment(self, text: str, indent: int = 0) -> None:
        pad = " " * indent
        for line in textwrap.wrap(text, WIDTH - indent - 2) or [""]:
            self.lines.append(f"{pad}# {line}".rstrip())

    def line(self, text: str, indent: int = 0) -> None:
        self.lines.append(" " * indent + text)

    def item(self, key: str, value: Any, indent: int, why: str | None = None) -> None:
        if why:
            self.comment(why, indent)
        self.line(f"{key}: {_scalar(value)}", indent)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    return json.dumps(value)


def render_pool(layout: PoolLayout, *, port: int = 8000) -> str:
    doc = _Doc()
    _header(doc, layout)
    doc.line("server:")
    doc.item("host", "127.0.0.1", 2)
    doc.item("port", port, 2)
    doc.item("state_dir", ".gpupool", 2, "compile and Triton caches per GPU architecture, logs")
    doc.line("")
    _model(doc, layout)
    doc.line("")
    doc.line("workers:")
    for w in layout.workers:
        _worker(doc, layout, w)
    doc.line("")
    doc.line("queue:")
    doc.item("backend", "memory", 2)
    doc.item("max_wait_s", 120, 2)
    return doc.text()


def _header(doc: _Doc, layout: PoolLayout) -> None:
    m = layout.model
    doc.comment(f"Written by `gpupool init` for {m.spec.name} on this host's GPUs.")
    doc.comment(f"Model shape from {m.source}.")
    if m.builtin:
        doc.comment(
            "The model's config.json was not at hand, so gpupool used its built-in shape of "
            "this model; run `gpupool plan --config` again once the model is downloaded."
        )
    doc.comment("Check: gpupool check --config <this file>; serve: gpupool serve --config <it>")
    doc.comment("Every flag below is the planner's choice for its card; the comment says why.")
    for reason in layout.left_out:
        doc.comment(f"Left out: {reason}")
    doc.comment(f"KV cache dtype: {layout.kv_cache_dtype}: {layout.kv_why}.")
    doc.line("")


def _model(doc: _Doc, layout: PoolLayout) -> None:
    spec = layout.model.spec
    doc.line("models:")
    doc.line(f"  - name: {_scalar(spec.name)}")
    alias = spec.name.rstrip("/").rsplit("/", 1)[-1].lower()
    if alias != spec.name:
        doc.item("aliases", [alias], 4)
    if layout.model.reasoning_parser:
        doc.item(
            "reasoning",
            "none",
            4,
            f"vLLM's --reasoning-parser {layout.model.reasoning_parser} (below) already "
            "splits the <think> trace into `reasoning`",
        )
    limits = _limits(layout)
    if limits is not None:
        doc.item("limits", limits, 4, _limits_why(layout))


def _limits(layout: PoolLayout) -> dict[str, int] | None:
    if layout.model.spec.vision is None:
        return None
    if not layout.multimodal:
        return {"image": 0, "video": 0}
    return {"image": layout.request.images, "video": layout.request.videos}


def _limits_why(layout: PoolLayout) -> str:
    if not layout.multimodal:
        return (
            "text only, as asked: the gateway refuses media and vLLM skips the vision "
            "encoder's memory (limit-mm-per-prompt 0)"
        )
    return (
        "media per prompt; the gateway answers 400 before a worker sees one more "
        "(the same limit goes to vLLM as limit-mm-per-prompt)"
    )


def _worker(doc: _Doc, layout: PoolLayout, w: WorkerLayout) -> None:
    f = w.flags
    gpus = f.target.gpus
    indices = ", ".join(str(g.index) for g in gpus)
    each = " each" if len(gpus) > 1 else ""
    doc.line(f"  - name: {w.name}")
    doc.comment(
        f"GPU {indices}: {gpus[0].name}, {gpus[0].memory_total_bytes / GiB:.1f} GiB{each}", 4
    )
    doc.item("model", layout.model.spec.name, 4)
    doc.line("launch:", 4)
    doc.item("gpus", [g.index for g in gpus], 6)
    doc.item("model_path", layout.request.model, 6)
    doc.line("args:", 6)
    for key, value, why in _args(layout, w):
        doc.item(key, value, 8, why)
    doc.line("env:", 6)
    doc.item(
        "VLLM_ENGINE_READY_TIMEOUT_S",
        str(STARTUP_TIMEOUT_S),
        8,
        "a cold start (weights, torch.compile, CUDA graphs) takes minutes",
    )
    doc.item("startup_timeout_s", STARTUP_TIMEOUT_S, 6)
    if w.start_after:
        doc.item(
            "start_after",
            list(w.start_after),
            6,
            f"seed 000's fix: {w.start_after[0]} (same GPU architecture, more memory) fills "
            "the shared Triton cache with its warm-up first, so this card's first requests "
            "find the kernels tuned instead of autotuning into the KV cache's memory",
        )
    if w.warms or (layout.model.spec.is_hybrid and not w.start_after):
        _warmup(doc, layout, w)


def _args(layout: PoolLayout, w: WorkerLayout) -> list[tuple[str, Any, str | None]]:
    f = w.flags
    p = f.plan
    out: list[tuple[str, Any, str | None]] = [
        ("gpu-memory-utilization", p.args.gpu_memory_utilization, f.utilization_why),
        ("max-model-len", p.max_model_len, f.context_why),
        ("max-num-seqs", p.max_num_seqs, f.seqs_why),
        ("max-num-batched-tokens", p.max_num_batched_tokens, f.batched_why),
        ("kv-cache-dtype", layout.kv_cache_dtype, _kv_note(p.kv_bytes_per_token, layout)),
    ]
    if f.target.tp > 1:
        out.append(
            (
                "tensor-parallel-size",
                f.target.tp,
                f"the weights ({p.weights.total * f.target.tp / GiB:.1f} GiB) need "
                f"{f.target.tp} of these GPUs; each holds {p.weights.total / GiB:.1f} GiB",
            )
        )
    if f.target.quantization:
        out.append(("quantization", f.target.quantization, f"weights: {p.quantization}"))
    if layout.model.reasoning_parser:
        out.append(
            (
                "reasoning-parser",
                layout.model.reasoning_parser,
                "the model thinks in <think> tags by default",
            )
        )
    limits = _limits(layout)
    if limits is not None:
        out.append(("limit-mm-per-prompt", limits, None))
    out.append(
        (
            "enable-prefix-caching",
            True,
            "repeated prompt prefixes (system prompts, chat history) skip prefill",
        )
    )
    return out


def _kv_note(bytes_per_token: int, layout: PoolLayout) -> str:
    return f"{bytes_per_token / 1024:.1f} KiB per token on each GPU (full-attention layers only)"


def _warmup(doc: _Doc, layout: PoolLayout, w: WorkerLayout) -> None:
    why = (
        "sent once the worker is healthy, before it takes traffic: each new tensor shape "
        "autotunes the Gated DeltaNet Triton kernels once, into the shared cache"
    )
    if w.warms:
        why += "; the smaller cards start after this, with the cache warm (seed 000)"
    doc.comment(why, 4)
    doc.line("warmup:", 4)
    for prompt, tokens in WARMUP_TEXT:
        doc.line(f"- prompt: {_scalar(prompt)}", 6)
        doc.line(f"  max_tokens: {tokens}", 6)
    if not layout.multimodal or layout.request.images < 1:
        return
    for size in WARMUP_IMAGES:
        doc.line('- prompt: "Describe this image."', 6)
        doc.line(f"  images: [{_scalar(list(size))}]", 6)
    if layout.request.images >= 2:
        doc.line('- prompt: "Compare these two images."', 6)
        doc.line("  images: [[256, 256], [512, 512]]", 6)
