"""Read a Hugging Face ``config.json`` into a typed :class:`ModelSpec`.

Handles dense and MoE decoders, hybrid linear/full attention (Qwen3-Next and Qwen3.5/3.6:
``layer_types`` or ``full_attention_interval``, Gated DeltaNet ``linear_*`` fields), local
attention layers (sliding windows: Gemma 2/3, Mistral-style ``sliding_window``, gpt-oss's
alternating ``layer_types``, Qwen's ``use_sliding_window``; Llama 4's chunked attention) and
vision-language configs, whose language model sits in a nested ``text_config`` (fields missing
there fall back to the top level, where VL configs keep ``tie_word_embeddings`` and
``quantization_config``).

Only what the memory arithmetic needs is read; everything else in the file is ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpupool.workers.planner.errors import ModelConfigError


class LayerKind(StrEnum):
    full_attention = "full_attention"
    sliding_attention = "sliding_attention"  # keeps the last ``sliding_window`` tokens
    chunked_attention = "chunked_attention"  # Llama 4: attends within ``attention_chunk_size``
    linear_attention = "linear_attention"


ATTENTION_KINDS = frozenset(
    {LayerKind.full_attention, LayerKind.sliding_attention, LayerKind.chunked_attention}
)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool = False


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """DeepSeek-style multi-head latent attention: one compressed K/V latent per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q is projected directly

    @property
    def latent_dim(self) -> int:
        """What vLLM caches per token and layer (``MLAAttentionSpec``: one head of this size)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class LinearAttentionSpec:
    """Gated DeltaNet layer shape (``linear_*`` fields of Qwen3-Next / Qwen3.5)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v concatenated."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class MoeSpec:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    dense_layers: int = 0  # layers that keep a dense MLP (``mlp_only_layers``)


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """A Qwen-VL style vision tower (ViT blocks + patch merger)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    architecture: str
    model_type: str
    dtype: str
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    layer_kinds: tuple[LayerKind, ...]
    attention: AttentionSpec
    linear: LinearAttentionSpec | None
    moe: MoeSpec | None
    vision: VisionSpec | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    mamba_ssm_dtype: str | None
    mtp_layers: int
    quantization_config: Mapping[str, Any] | None
    sliding_window: int | None = None  # tokens a sliding_attention layer keeps
    attention_chunk_size: int | None = None  # tokens of a chunked_attention layer's chunk
    mla: MlaSpec | None = None  # DeepSeek-style latent attention (``kv_lora_rank``)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def full_attention_layers(self) -> int:
        return self.layer_kinds.count(LayerKind.full_attention)

    @property
    def attention_layers(self) -> int:
        """Layers with a K/V projection and KV cache: full, sliding-window and chunked."""
        return sum(1 for k in self.layer_kinds if k in ATTENTION_KINDS)

    @property
    def sliding_attention_layers(self) -> int:
        return self.layer_kinds.count(LayerKind.sliding_attention)

    @property
    def chunked_attention_layers(self) -> int:
        return self.layer_kinds.count(LayerKind.chunked_attention)

    @property
    def linear_attention_layers(self) -> int:
        return self.layer_kinds.count(LayerKind.linear_attention)

    @property
    def is_hybrid(self) -> bool:
        return self.linear is not None and self.linear_attention_layers > 0


def load_model_spec(path: str | Path) -> ModelSpec:
    """Read ``path`` (a ``config.json`` or a directory holding one)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelConfigError(f"{file}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ModelConfigError(f"{file}: not valid JSON: {e}") from None
    name = file.parent.name if file.name == "config.json" else file.stem
    return parse_model_spec(data, name=name)


def parse_model_spec(data: Any, *, name: str = "model") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json``."""
    if not isinstance(data, dict):
        raise ModelConfigError(f"{name}: config.json must hold a JSON object")
    text = _text_config(data)
    layers = _int(text, "num_hidden_layers", name)
    linear = _linear_spec(text, name)
    kinds = _layer_kinds(text, layers, has_linear=linear is not None, name=name)
    window = _opt_int(text, "sliding_window", name)
    chunk = _opt_int(text, "attention_chunk_size", name)
    if LayerKind.sliding_attention in kinds and not window:
        raise ModelConfigError(f"{name}: sliding-window layers but no `sliding_window`")
    return ModelSpec(
        name=name,
        architecture=_first_architecture(data),
        model_type=str(data.get("model_type", text.get("model_type", ""))),
        dtype=str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"),
        hidden_size=_int(text, "hidden_size", name),
        vocab_size=_int(text, "vocab_size", name),
        intermediate_size=_opt_int(text, "intermediate_size", name) or 0,
        layer_kinds=kinds,
        attention=_attention_spec(text, name),
        linear=linear,
        moe=_moe_spec(text, name),
        vision=_vision_spec(data.get("vision_config"), name),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        max_position_embeddings=_max_positions(text, name),
        mamba_ssm_dtype=_opt_str(text, "mamba_ssm_dtype"),
        mtp_layers=_opt_int(text, "mtp_num_hidden_layers", name) or 0,
        quantization_config=_quantization_config(data, text),
        sliding_window=window if LayerKind.sliding_attention in kinds else None,
        attention_chunk_size=chunk if LayerKind.chunked_attention in kinds else None,
        mla=_mla_spec(text, name),
    )


def _mla_spec(text: Mapping[str, Any], name: str) -> MlaSpec | None:
    rank = _opt_int(text, "kv_lora_rank", name)
    if not rank:
        return None
    return MlaSpec(
        kv_lora_rank=rank,
        qk_rope_head_dim=_opt_int(text, "qk_rope_head_dim", name) or 64,
        qk_nope_head_dim=_opt_int(text, "qk_nope_head_dim", name) or 128,
        v_head_dim=_opt_int(text, "v_head_dim", name) or 128,
        q_lora_rank=_opt_int(text, "q_lora_rank", name) or 0,
    )


def _text_config(data: dict[str, Any]) -> dict[str, Any]:
    nested = data.get("text_config")
    if not isinstance(nested, dict):
        return data
    outer = {k: v for k, v in data.items() if k not in ("text_config", "vision_config")}
    return {**outer, **nested}


def _first_architecture(data: Mapping[str, Any]) -> str:
    archs = data.get("architectures")
    if isinstance(archs, list) and archs:
        return str(archs[0])
    return ""


def _int(d: Mapping[str, Any], key: str, name: str) -> int:
    value = _opt_int(d, key, name)
    if value is None:
        raise ModelConfigError(f"{name}: config.json has no `{key}`")
    return value


def _opt_int(d: Mapping[str, Any], key: str, name: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"{name}: `{key}` must be a non-negative integer, got {value!r}")
    return value


def _opt_str(d: Mapping[str, Any], key: str) -> str | None:
    value = d.get(key)
    return str(value) if value is not None else None


def _attention_spec(text: Mapping[str, Any], name: str) -> AttentionSpec:
    heads = _int(text, "num_attention_heads", name)
    if heads == 0:
        raise ModelConfigError(f"{name}: `num_attention_heads` must be positive")
    kv_heads = _opt_int(text, "num_key_value_heads", name) or heads
    head_dim = _opt_int(text, "head_dim", name) or _int(text, "hidden_size", name) // heads
    gate = bool(text.get("attn_output_gate", False))
    return AttentionSpec(heads, kv_heads, head_dim, gate)


def _linear_spec(text: Mapping[str, Any], name: str) -> LinearAttentionSpec | None:
    value_heads = _opt_int(text, "linear_num_value_heads", name)
    if not value_heads:
        return None
    return LinearAttentionSpec(
        num_key_heads=_opt_int(text, "linear_num_key_heads", name) or value_heads,
        num_value_heads=value_heads,
        key_head_dim=_opt_int(text, "linear_key_head_dim", name) or 128,
        value_head_dim=_opt_int(text, "linear_value_head_dim", name) or 128,
        conv_kernel=_opt_int(text, "linear_conv_kernel_dim", name) or 4,
    )


def _layer_kinds(
    text: Mapping[str, Any], layers: int, *, has_linear: bool, name: str
) -> tuple[LayerKind, ...]:
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != layers:
            raise ModelConfigError(
                f"{name}: `layer_types` has {len(types)} entries for {layers} layers"
            )
        return tuple(_kind(str(t)) for t in types)
    interval = _opt_int(text, "full_attention_interval", name)
    if has_linear and interval:
        return tuple(
            LayerKind.full_attention if (i + 1) % interval == 0 else LayerKind.linear_attention
            for i in range(layers)
        )
    return _local_attention_kinds(text, layers, name) or (LayerKind.full_attention,) * layers


def _local_attention_kinds(
    text: Mapping[str, Any], layers: int, name: str
) -> tuple[LayerKind, ...] | None:
    """Sliding-window or chunked layers of configs without ``layer_types``, as vLLM reads them.

    Gemma 3: every ``sliding_window_pattern``-th layer is global (default 6); Gemma 2: even
    layers slide; Qwen2/3 ``use_sliding_window``: layers from ``max_window_layers`` on slide;
    Mistral-style ``sliding_window`` alone: every layer slides; Llama 4 ``attention_chunk_size``:
    layers whose ``no_rope_layers`` entry is 1 (default: all but every 4th) are chunked."""
    chunk = _opt_int(text, "attention_chunk_size", name)
    if chunk:
        return _chunked_kinds(text, layers)
    window = _opt_int(text, "sliding_window", name)
    model_type = str(text.get("model_type", ""))
    if not window or text.get("use_sliding_window") is False:
        return None
    slide, full = LayerKind.sliding_attention, LayerKind.full_attention
    if model_type.startswith("gemma3"):
        pattern = _opt_int(text, "sliding_window_pattern", name) or 6
        return tuple(full if (i + 1) % pattern == 0 else slide for i in range(layers))
    if model_type.startswith("gemma2"):
        return tuple(slide if i % 2 == 0 else full for i in range(layers))
    if text.get("use_sliding_window"):
        start = _opt_int(text, "max_window_layers", name) or 0
        return tuple(slide if i >= start else full for i in range(layers))
    return (slide,) * layers


def _chunked_kinds(text: Mapping[str, Any], layers: int) -> tuple[LayerKind, ...]:
    rope = text.get("no_rope_layers")
    if isinstance(rope, list) and len(rope) == layers:
        flags = [bool(r) for r in rope]
    else:
        flags = [(i + 1) % 4 != 0 for i in range(layers)]
    return tuple(LayerKind.chunked_attention if f else LayerKind.full_attention for f in flags)


_KINDS = {
    "sliding_attention": LayerKind.sliding_attention,
    "sliding_window": LayerKind.sliding_attention,
    "local_attention": LayerKind.sliding_attention,
    "chunked_attention": LayerKind.chunked_attention,
    "linear_attention": LayerKind.linear_attention,
    "mamba": LayerKind.linear_attention,
    "gated_deltanet": LayerKind.linear_attention,
}


def _kind(layer_type: str) -> LayerKind:
    return _KINDS.get(layer_type, LayerKind.full_attention)


def _moe_spec(text: Mapping[str, Any], name: str) -> MoeSpec | None:
    experts = next(
        (
            n
            for key in ("num_experts", "num_local_experts", "n_routed_experts")
            if (n := _opt_int(text, key, name))
        ),
        None,
    )
    if not experts:
        return None
    expert_size = _opt_int(text, "moe_intermediate_size", name)
    expert_size = expert_size or _int(text, "intermediate_size", name)
    mlp_only = text.get("mlp_only_layers")
    dense = len(mlp_only) if isinstance(mlp_only, list) else 0
    return MoeSpec(
        num_experts=experts,
        experts_per_token=_opt_int(text, "num_experts_per_tok", name) or 1,
        expert_intermediate_size=expert_size,
        shared_intermediate_size=_shared_size(text, expert_size, name),
        dense_layers=dense or _opt_int(text, "first_k_dense_replace", name) or 0,  # DeepSeek
    )


def _shared_size(text: Mapping[str, Any], expert_size: int, name: str) -> int:
    shared = _opt_int(text, "shared_expert_intermediate_size", name)
    if shared is not None:
        return shared
    return (_opt_int(text, "n_shared_experts", name) or 0) * expert_size


def _vision_spec(vision: Any, name: str) -> VisionSpec | None:
    if not isinstance(vision, dict) or "depth" not in vision:
        return None
    hidden = _int(vision, "hidden_size", name)
    return VisionSpec(
        depth=_int(vision, "depth", name),
        hidden_size=hidden,
        intermediate_size=_opt_int(vision, "intermediate_size", name) or 4 * hidden,
        out_hidden_size=_opt_int(vision, "out_hidden_size", name) or hidden,
        patch_size=_opt_int(vision, "patch_size", name) or 16,
        temporal_patch_size=_opt_int(vision, "temporal_patch_size", name) or 2,
        in_channels=_opt_int(vision, "in_channels", name) or 3,
        spatial_merge_size=_opt_int(vision, "spatial_merge_size", name) or 2,
        num_position_embeddings=_opt_int(vision, "num_position_embeddings", name) or 0,
    )


def _max_positions(text: Mapping[str, Any], name: str) -> int:
    positions = _opt_int(text, "max_position_embeddings", name) or 0
    scaling = text.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        factor = scaling.get("factor")
        if isinstance(factor, int | float) and factor > 1:
            base = scaling.get("original_max_position_embeddings", positions)
            positions = max(positions, int(base * factor))
    return positions


def _quantization_config(
    data: Mapping[str, Any], text: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    for source in (data, text):
        q = source.get("quantization_config")
        if isinstance(q, dict):
            return q
    return None
