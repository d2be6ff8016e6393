"""Parameter counts per component, from the shapes in a :class:`ModelSpec`.

Components are what quantization treats differently: checkpoints quantize the big linear
projections (attention, Gated DeltaNet, MLP, experts) and keep embeddings, the LM head, the MoE
router, norms and usually the vision tower in the model dtype.

Counts follow the Qwen3 / Qwen3-Next / Qwen3.5 module layout (gated q_proj when
``attn_output_gate``; GDN ``in_proj_qkvz`` + ``in_proj_ba`` + conv1d + ``out_proj``; SwiGLU MLPs;
Qwen-VL vision blocks with a 2-layer MLP and a patch merger). Biases are ignored (Qwen3 has none).
The multi-token-prediction layer is counted only when asked: vLLM loads it only for MTP
speculative decoding.
"""

from __future__ import annotations

from enum import StrEnum

from gpupool.workers.planner.model_spec import ModelSpec, VisionSpec


class Component(StrEnum):
    embed = "embed"
    lm_head = "lm_head"
    attention = "attention"
    linear_attention = "linear_attention"
    mlp = "mlp"
    experts = "experts"
    shared_experts = "shared_experts"
    router = "router"
    norms = "norms"
    vision = "vision"
    mtp = "mtp"


def count_params(spec: ModelSpec, *, include_mtp: bool = False) -> dict[Component, int]:
    """Parameters per component (components a model lacks are left out)."""
    full = spec.attention_layers  # sliding-window and chunked layers have the same weights
    linear = spec.linear_attention_layers
    counts = {
        Component.embed: spec.vocab_size * spec.hidden_size,
        Component.lm_head: 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size,
        Component.attention: full * attention_layer_params(spec),
        Component.linear_attention: linear * linear_attention_layer_params(spec),
        Component.norms: (2 * spec.num_layers + 1) * spec.hidden_size,
        Component.vision: vision_params(spec.vision) if spec.vision else 0,
        **_mlp_counts(spec),
    }
    if include_mtp and spec.mtp_layers:
        counts[Component.mtp] = spec.mtp_layers * mtp_layer_params(spec)
    return {k: v for k, v in counts.items() if v}


def total_params(spec: ModelSpec, *, include_mtp: bool = False) -> int:
    return sum(count_params(spec, include_mtp=include_mtp).values())


def attention_layer_params(spec: ModelSpec) -> int:
    if spec.mla is not None:
        return mla_layer_params(spec)
    a = spec.attention
    h = spec.hidden_size
    q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    kv_out = 2 * a.num_kv_heads * a.head_dim
    o_proj = a.num_heads * a.head_dim * h
    qk_norms = 2 * a.head_dim
    return h * (q_out + kv_out) + o_proj + qk_norms


def mla_layer_params(spec: ModelSpec) -> int:
    """DeepSeek's latent attention: q (through q_lora_rank when set), the K/V down-projection
    to the latent plus the rope key, its up-projection per head, o; and the two latent norms."""
    m, h, heads = spec.mla, spec.hidden_size, spec.attention.num_heads
    assert m is not None
    q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * m.q_lora_rank + m.q_lora_rank * heads * q_head if m.q_lora_rank else h * heads * q_head
    kv_down = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_up = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    o = heads * m.v_head_dim * h
    return q + kv_down + kv_up + o + m.q_lora_rank + m.kv_lora_rank


def linear_attention_layer_params(spec: ModelSpec) -> int:
    lin = spec.linear
    if lin is None:
        return 0
    h = spec.hidden_size
    qkvz = h * (2 * lin.key_dim + 2 * lin.value_dim)
    ba = h * 2 * lin.num_value_heads
    conv = lin.conv_dim * lin.conv_kernel
    small = 2 * lin.num_value_heads + lin.value_head_dim  # A_log, dt_bias, gated norm
    out = lin.value_dim * h
    return qkvz + ba + conv + small + out


def _mlp_counts(spec: ModelSpec) -> dict[Component, int]:
    h = spec.hidden_size
    moe = spec.moe
    if moe is None:
        return {Component.mlp: spec.num_layers * 3 * h * spec.intermediate_size}
    moe_layers = spec.num_layers - moe.dense_layers
    shared = moe.shared_intermediate_size
    return {
        Component.mlp: moe.dense_layers * 3 * h * spec.intermediate_size,
        Component.experts: moe_layers * moe.num_experts * 3 * h * moe.expert_intermediate_size,
        Component.shared_experts: moe_layers * 3 * h * shared,
        Component.router: moe_layers * (h * moe.num_experts + (h if shared else 0)),
    }


def mlp_layer_params(spec: ModelSpec) -> int:
    """One decoder layer's MLP (all experts included for MoE)."""
    h = spec.hidden_size
    moe = spec.moe
    if moe is None:
        return 3 * h * spec.intermediate_size
    shared = moe.shared_intermediate_size
    experts = moe.num_experts * 3 * h * moe.expert_intermediate_size
    return experts + 3 * h * shared + h * moe.num_experts + (h if shared else 0)


def mtp_layer_params(spec: ModelSpec) -> int:
    """One MTP block: a full-attention decoder layer plus the fc that joins two hidden states."""
    h = spec.hidden_size
    return attention_layer_params(spec) + mlp_layer_params(spec) + 2 * h * h + 4 * h


def vision_params(v: VisionSpec) -> int:
    h = v.hidden_size
    block = 4 * h * h + 2 * h * v.intermediate_size + 4 * h
    merged = h * v.spatial_merge_size**2
    merger = merged * merged + merged * v.out_hidden_size + 2 * h
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h
    positions = v.num_position_embeddings * h
    return v.depth * block + merger + patch + positions
