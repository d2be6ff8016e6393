"""The byte arithmetic, per GPU: weights, runtime overhead, KV per token, linear-attention state.

How vLLM spends a GPU (v1 worker, ``determine_available_memory``)::

    total ── what CUDA reports: NVML's total less what the driver keeps (H200: 139.8 of 140.4 GiB)
           ├─ CUDA total x gpu-memory-utilization  (the budget vLLM sizes itself to)
           │   ├─ weights
           │   ├─ overhead: peak activations of a max-num-batched-tokens forward pass,
           │   │            the sampler run over max-num-seqs rows, CUDA graphs,
           │   │            non-torch allocations (cuBLAS workspaces, NCCL buffers when TP > 1),
           │   │            backend workspaces (flashinfer_b12x MoE: seed 004)
           │   └─ KV cache: whatever is left
           └─ outside the budget: the CUDA context (taken before vLLM's baseline snapshot) and
              anything allocated later outside PyTorch's pool, such as Triton's autotuner
              benchmarking buffers on the first request (seed 000).

vLLM 0.26.0 sizes two kinds of model differently (its H200 logs: ``Actual usage is W GiB for
weight, A GiB for peak activation, N GiB for non-torch memory, and C GiB for CUDAGraph memory``):

- plain decoders (dense, full or local attention) run on ``model_runner.py``: the profile run's
  peak is the forward pass plus the logits of max-num-seqs rows (bf16 and an fp32 copy, 6 bytes a
  logit); CUDA graphs are captured after the KV cache is sized, outside the budget (0.16 GiB at
  21 sequences, 0.40 GiB at 128 for an 8B). Measured: 0.84 GiB peak, 0.22 GiB non-torch for a
  Qwen3-8B-like model; a Llama-3.1-8B-like one at 1,024 sequences fits 6 bytes a logit.
- MoE and Gated DeltaNet hybrids run on ``gpu_model_runner.py``: the sampler's pass over
  max-num-seqs rows costs bf16 logits, an fp32 copy and fp32 probabilities (10 bytes a logit),
  and CUDA graph memory is profiled and kept out of the KV cache. That grows with the largest
  captured batch, ``min(2 x max-num-seqs, 512)``: 0.12 GiB logged at 16 for a hybrid, and a
  Qwen3-30B-A3B-like MoE at 20 and at 1,024 sequences (67.74 and 65.38 GiB of KV cache) fits
  0.2 GiB + 2 MiB per captured batch slot.

Overhead is an estimate, and two bases are offered:

- ``estimate`` (default): the components above, from the model's shapes. Seed 004 measured the
  non-KV part for Qwen3.6-35B-A3B NVFP4 on a 96 GB card: 87.94 GiB budget - 64.36 GiB KV cache
  = 23.58 GiB, of which about 22 GiB are weights, so overhead ≈ 1.5 GiB ≈ 7 % of the weights.
- ``fraction``: a fixed share of the weights, the sizing guide's rule of thumb (seed 001:
  "15-20 % activation and framework overhead"). Conservative for MoE models with few sequences,
  close to the estimate for dense models at vLLM's default 256/1024 sequences (the sampler over
  Qwen's 248K vocabulary is then GiBs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpupool.workers.planner.dtypes import dtype_bytes
from gpupool.workers.planner.model_spec import LinearAttentionSpec, ModelSpec
from gpupool.workers.planner.params import Component, count_params
from gpupool.workers.planner.quant import Precision, QuantScheme

MiB = 1 << 20
GiB = 1 << 30

CUDA_RESERVED_BYTES = 616 * MiB
"""NVML's total less what CUDA reports as total, which vLLM's budget is a fraction of (H200:
143,771 MiB against 139.8 GiB)."""
CUDA_CONTEXT_BYTES = 512 * MiB
"""CUDA context + kernels loaded lazily; outside vLLM's budget (typ. 0.3-0.8 GiB per process)."""
GRAPH_BASE_BYTES = 200 * MiB
GRAPH_BYTES_PER_SLOT = 2 * MiB
"""CUDA graph memory the MoE/hybrid runner profiles and keeps out of the KV cache: a base and
so much per slot of the largest captured batch (fitted on the H200, vLLM 0.26.0)."""
PLAIN_GRAPH_BASE_BYTES = 115 * MiB
PLAIN_GRAPH_BYTES_PER_SLOT = round(1.1 * MiB)
"""A plain decoder's CUDA graphs, captured after sizing (8B: 0.16 GiB at 42 slots, 0.40 at 256)."""
MAX_CAPTURE = 512
"""vLLM's largest captured batch is ``min(2 x max-num-seqs, 512)``."""
NON_TORCH_BYTES = 256 * MiB
"""cuBLAS/cuDNN workspaces and allocator slack that vLLM counts as non-torch memory."""
NCCL_BYTES = 512 * MiB
"""NCCL and custom all-reduce buffers, only when tensor-parallel-size > 1."""
LOGIT_BYTES_PLAIN = 6
"""Profile-run logits of a plain decoder over max-num-seqs rows: bf16 and an fp32 copy."""
LOGIT_BYTES_SAMPLER = 10
"""The same on the MoE/hybrid runner's sampler: bf16 logits, an fp32 copy, fp32 probabilities."""
GDN_CHUNK = 64
"""Gated DeltaNet chunked prefill keeps one fp32 state per head per 64-token chunk."""
BACKEND_WORKSPACE_BYTES: Mapping[str, int] = {"flashinfer_b12x": round(11.47 * GiB)}
"""Measured extra reservation of MoE backends over Marlin (seed 004: 64.36 - 52.89 GiB)."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Weight bytes per GPU, by component, with the precision each is stored in."""

    by_component: Mapping[Component, int]
    precision: Mapping[Component, str]

    @property
    def total(self) -> int:
        return sum(self.by_component.values())


def model_precision(spec: ModelSpec) -> Precision:
    """The unquantized dtype; vLLM's ``--dtype auto`` loads float32 checkpoints in bfloat16."""
    name = spec.dtype.removeprefix("torch.").lower()
    size = dtype_bytes(name)
    if size > 2:
        return Precision("bf16", 2.0)
    return Precision(_SHORT.get(name, name), size)


_SHORT = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


_REPLICATED = frozenset({Component.norms, Component.router})


def weight_bytes(
    spec: ModelSpec, scheme: QuantScheme, *, tp: int = 1, include_mtp: bool = False
) -> Weights:
    """Bytes per GPU: everything but norms and the router is split across TP ranks."""
    base = model_precision(spec)
    sizes: dict[Component, int] = {}
    names: dict[Component, str] = {}
    for component, n in count_params(spec, include_mtp=include_mtp).items():
        p = scheme.precision_of(component, base)
        share = 1 if component in _REPLICATED else tp
        sizes[component] = math.ceil(n * p.bytes_per_param / share)
        names[component] = p.name
    return Weights(sizes, names)


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """KV heads each rank stores; replicated (one per rank) when TP exceeds them."""
    return max(1, spec.attention.num_kv_heads // tp)


def attention_bytes_per_token_layer(spec: ModelSpec, kv_bytes: float, tp: int) -> int:
    """K and V of one token in one attention layer, on one GPU. MLA caches one latent of
    ``kv_lora_rank + qk_rope_head_dim`` instead, on every rank whole (vLLM's ``MLAAttentionSpec``:
    one head, no separate V)."""
    if spec.mla is not None:
        return round(spec.mla.latent_dim * kv_bytes)
    return round(2 * kv_heads_per_gpu(spec, tp) * spec.attention.head_dim * kv_bytes)


def kv_bytes_per_token(spec: ModelSpec, kv_bytes: float, tp: int) -> int:
    """KV bytes per token per GPU; only full-attention layers keep per-token state."""
    return attention_bytes_per_token_layer(spec, kv_bytes, tp) * spec.full_attention_layers


def linear_state_bytes_layer(
    lin: LinearAttentionSpec, tp: int, conv_bytes: float, ssm_bytes: float
) -> int:
    """One sequence's Gated DeltaNet state in one layer on one GPU (vLLM's mamba page).

    conv state: (kernel - 1) x conv_dim / TP in the conv dtype;
    recurrent state: value_heads / TP x value_head_dim x key_head_dim in the SSM dtype.
    """
    conv = (lin.conv_kernel - 1) * (lin.conv_dim // tp) * conv_bytes
    ssm = (lin.num_value_heads // tp) * lin.value_head_dim * lin.key_head_dim * ssm_bytes
    return round(conv + ssm)


@dataclass(frozen=True, slots=True)
class Overhead:
    """Non-KV memory inside the budget besides the weights, per GPU."""

    basis: str
    activations: int = 0
    sampler: int = 0
    cuda_graphs: int = 0
    non_torch: int = 0
    backend_workspace: int = 0
    rule_of_thumb: int = 0
    graphs_after_sizing: int = 0  # captured once the KV cache is sized: outside the budget

    @property
    def total(self) -> int:
        return (
            self.activations
            + self.sampler
            + self.cuda_graphs
            + self.non_torch
            + self.backend_workspace
            + self.rule_of_thumb
        )


@dataclass(frozen=True, slots=True)
class OverheadInputs:
    tp: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enforce_eager: bool = False
    moe_backend: str | None = None
    fraction: float | None = None  # seed 001's rule instead of the estimate


def cuda_visible_bytes(nvml_total: int) -> int:
    """The total CUDA reports for a card NVML says has ``nvml_total`` bytes."""
    return max(0, nvml_total - CUDA_RESERVED_BYTES)


def profiles_graphs(spec: ModelSpec) -> bool:
    """Whether vLLM 0.26.0 runs ``spec`` on the runner that profiles CUDA graphs into its budget
    (MoE and Gated DeltaNet hybrids), rather than capturing them after sizing (plain decoders)."""
    return spec.moe is not None or spec.is_hybrid


def estimate_overhead(spec: ModelSpec, weights: int, inputs: OverheadInputs) -> Overhead:
    workspace = BACKEND_WORKSPACE_BYTES.get(inputs.moe_backend or "", 0)
    profiled = profiles_graphs(spec)
    if inputs.fraction is not None:
        rule = round(inputs.fraction * weights)
        return Overhead(
            f"{inputs.fraction:.0%} of weights", backend_workspace=workspace, rule_of_thumb=rule
        )
    logit = LOGIT_BYTES_SAMPLER if profiled else LOGIT_BYTES_PLAIN
    return Overhead(
        "estimate",
        activations=activation_bytes(spec, inputs.max_num_batched_tokens, inputs.tp),
        sampler=inputs.max_num_seqs * spec.vocab_size * logit,
        cuda_graphs=graph_bytes(inputs, moe=spec.moe is not None) if profiled else 0,
        non_torch=NON_TORCH_BYTES + (NCCL_BYTES if inputs.tp > 1 else 0),
        backend_workspace=workspace,
        graphs_after_sizing=0 if profiled else graph_bytes(inputs, plain=True),
    )


def graph_bytes(inputs: OverheadInputs, *, plain: bool = False, moe: bool = False) -> int:
    """CUDA graph memory for the largest captured batch (0 with --enforce-eager)."""
    if inputs.enforce_eager:
        return 0
    slots = min(2 * inputs.max_num_seqs, MAX_CAPTURE)
    if plain:
        return PLAIN_GRAPH_BASE_BYTES + slots * PLAIN_GRAPH_BYTES_PER_SLOT
    return GRAPH_BASE_BYTES + (slots * GRAPH_BYTES_PER_SLOT if moe else 0)


def activation_bytes(spec: ModelSpec, tokens: int, tp: int) -> int:
    """Peak activations of one forward pass over ``tokens`` (vLLM's profile run).

    bf16 residual, normed input, attention output and projections (~4 x hidden per token) plus
    the SwiGLU intermediate (gate+up and the product: 3 x width / TP), where width is the dense
    intermediate size or, for MoE, top-k x expert size + shared expert size; for MoE also the
    fused kernel's per-expert outputs before they are summed (top-k x hidden, its third cache);
    plus the fp32 per-chunk Gated DeltaNet states of chunked prefill.
    """
    per_token = 2 * (4 * spec.hidden_size + 3 * _ffn_width(spec) // tp)
    if spec.moe is not None:
        per_token += 2 * spec.moe.experts_per_token * spec.hidden_size
    gdn = 0
    if spec.linear is not None and spec.linear_attention_layers:
        lin = spec.linear
        per_chunk = (lin.num_value_heads // tp) * lin.key_head_dim * lin.value_head_dim * 4
        gdn = math.ceil(tokens / GDN_CHUNK) * per_chunk
    return tokens * per_token + gdn


def _ffn_width(spec: ModelSpec) -> int:
    moe = spec.moe
    if moe is None:
        return spec.intermediate_size
    routed = moe.experts_per_token * moe.expert_intermediate_size + moe.shared_intermediate_size
    return max(routed, spec.intermediate_size if moe.dense_layers else 0)
