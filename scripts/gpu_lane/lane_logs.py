"""Figures read from a vLLM worker log (one launch: from gpupool's last launch marker)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MARKER = "===== gpupool: launching "
_NUM = r"([\d,]+(?:\.\d+)?)"
PATTERNS: dict[str, str] = {
    "kv_cache_tokens": rf"GPU KV cache size: {_NUM} tokens",
    "kv_cache_gib": rf"Available KV cache memory: {_NUM} GiB",
    "max_concurrency": rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x",
    "weights_gib": rf"Model loading took {_NUM} GiB",
    "weights_load_s": rf"Model loading took {_NUM} GiB(?: memory)? and {_NUM} s",
    "torch_compile_s": rf"torch\.compile (?:takes|took) {_NUM} s in total",
    "compile_cache_load_s": rf"(?:Directly load|Loading) the compiled graph.*?took {_NUM} s",
    "compile_graph_s": rf"Compiling a graph for .*?takes {_NUM} s",
    "graph_capture_s": rf"Graph capturing finished in {_NUM} secs?",
    "init_engine_s": rf"init engine \(profile, create kv cache, warmup model\) took {_NUM} s",
    "init_engine_compile_s": rf"warmup model\) took [\d.]+ s \(compilation: {_NUM} s",
    "attention_block_size": rf"Setting attention block size to {_NUM} tokens",
    "mamba_page_padding_pct": rf"Padding mamba page size by {_NUM}%",
}
KEEP = re.compile(
    r"KV cache|Maximum concurrency|Model loading took|torch\.compile|compiled graph|"
    r"Compiling a graph|Graph capturing|init engine|block size|mamba page|out of memory|"
    r"OutOfMemory|Traceback|Error|autotun|Starting vLLM|cache dir|non-torch|CUDA graph",
    re.IGNORECASE,
)


def launches(path: Path) -> list[str]:
    """The log's text split per launch (gpupool writes a marker line before each)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    parts = text.split(MARKER)
    return parts[1:] if len(parts) > 1 else [text]


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def figures(text: str) -> dict[str, Any]:
    """Every pattern's last match (a number, or a list for several groups)."""
    out: dict[str, Any] = {}
    for key, pattern in PATTERNS.items():
        matches = re.findall(pattern, text)
        if not matches:
            continue
        last = matches[-1]
        if key == "weights_load_s":
            out[key] = _number(last[1])
        elif isinstance(last, tuple):
            out[key] = [_number(x) for x in last]
        else:
            out[key] = _number(last)
        if key == "compile_graph_s":
            out["compile_graph_s_sum"] = round(sum(_number(m) for m in matches), 2)
    return out


def key_lines(text: str, limit: int = 40) -> list[str]:
    lines = [ln.strip()[:300] for ln in text.splitlines() if KEEP.search(ln)]
    lines = [ln for ln in lines if "Capturing CUDA graph" not in ln]
    return lines[-limit:]


def worker_launches(path: Path) -> list[dict[str, Any]]:
    """Per launch of one worker: its figures and the lines worth reading."""
    return [{"figures": figures(t), "lines": key_lines(t)} for t in launches(path)]
