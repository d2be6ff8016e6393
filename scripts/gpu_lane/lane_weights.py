"""Real-format weights for a dense shape: random bf16 tensors in safetensors, named as the Hugging
Face checkpoint of a Qwen3 / Llama model names them.

Why: a level-2 wake calls vLLM's ``reload_weights``, which reads the checkpoint from disk again
through the model loader. With ``--load-format dummy`` there is nothing to read: vLLM 0.26
raises ``NotImplementedError("Model reloading with `dummy` format")`` (``gpu_model_runner.py``),
the wake fails and gpupool restarts the worker. So the level-2 phase serves weights written
here (``load-format`` auto): a start and every level-2 wake read them (from the page cache after
the first). Written shard by shard (four layers each), generated on the GPU when there is one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LAYERS_PER_SHARD = 4


def tensors(cfg: dict[str, Any]) -> Iterator[tuple[int, str, tuple[int, ...]]]:
    """(shard, name, shape) of every parameter of a dense Qwen3 / Llama checkpoint."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    layers = cfg["num_hidden_layers"]
    last = (layers - 1) // LAYERS_PER_SHARD
    yield 0, "model.embed_tokens.weight", (vocab, h)
    for n in range(layers):
        shard, p = n // LAYERS_PER_SHARD, f"model.layers.{n}."
        yield shard, p + "self_attn.q_proj.weight", (heads * hd, h)
        yield shard, p + "self_attn.k_proj.weight", (kv_heads * hd, h)
        yield shard, p + "self_attn.v_proj.weight", (kv_heads * hd, h)
        yield shard, p + "self_attn.o_proj.weight", (h, heads * hd)
        if cfg.get("model_type") == "qwen3":
            yield shard, p + "self_attn.q_norm.weight", (hd,)
            yield shard, p + "self_attn.k_norm.weight", (hd,)
        yield shard, p + "mlp.gate_proj.weight", (inter, h)
        yield shard, p + "mlp.up_proj.weight", (inter, h)
        yield shard, p + "mlp.down_proj.weight", (h, inter)
        yield shard, p + "input_layernorm.weight", (h,)
        yield shard, p + "post_attention_layernorm.weight", (h,)
    yield last, "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings", False):
        yield last, "lm_head.weight", (vocab, h)


def write(model_dir: Path) -> dict[str, Any]:
    """Write ``model-NNNNN.safetensors`` beside ``config.json``; sizes and seconds."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("architectures") not in (["Qwen3ForCausalLM"], ["LlamaForCausalLM"]):
        raise ValueError(f"no checkpoint layout for {cfg.get('architectures')}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.monotonic()
    shards: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for shard, name, shape in tensors(cfg):
        shards.setdefault(shard, []).append((name, shape))
    written = 0
    for shard, params in sorted(shards.items()):
        out = {}
        for name, shape in params:
            if len(shape) == 1:  # norms: ones, as a trained model's are near 1
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02).cpu()
            out[name] = t
            written += t.numel() * 2
        save_file(out, str(model_dir / f"model-{shard:05d}.safetensors"), metadata={"format": "pt"})
    return {
        "shards": len(shards),
        "gib": round(written / 2**30, 2),
        "seconds": round(time.monotonic() - t0, 1),
        "device": device,
    }
