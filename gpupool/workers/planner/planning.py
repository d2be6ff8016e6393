"""``plan_from_args``: the whole memory plan of one vLLM launch, as a pure function."""

from __future__ import annotations

from dataclasses import replace

from gpupool.workers.planner.dtypes import kv_cache_bytes, state_dtype
from gpupool.workers.planner.errors import PlanArgsError
from gpupool.workers.planner.kv_layout import (
    DEFAULT_KERNEL_BLOCK,
    AttentionLayers,
    KvLayout,
    attention_layout,
    hybrid_layout,
    kv_capacity,
    longest_fitting_len,
)
from gpupool.workers.planner.memory import (
    CUDA_CONTEXT_BYTES,
    GiB,
    OverheadInputs,
    attention_bytes_per_token_layer,
    cuda_visible_bytes,
    estimate_overhead,
    linear_state_bytes_layer,
    model_precision,
    weight_bytes,
)
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.plan import Plan, PlanArgs
from gpupool.workers.planner.quant import resolve_scheme
from gpupool.workers.planner.verdicts import plan_findings

MLA_KERNEL_BLOCK = 64
"""vLLM forces 64-token blocks for FlashMLA, the MLA backend on Hopper."""


def default_limits(gpu_memory_bytes: int) -> tuple[int, int]:
    """vLLM's OpenAI-server defaults (max-num-seqs, max-num-batched-tokens) for a GPU size."""
    if gpu_memory_bytes >= 160 * GiB:
        return 1024, 16384
    if gpu_memory_bytes >= 70 * GiB:
        return 1024, 8192
    return 256, 2048


def plan_from_args(spec: ModelSpec, args: PlanArgs) -> Plan:
    """Plan ``spec`` under ``args``. Raises :class:`PlanArgsError` for values it cannot use."""
    _validate(args)
    tp = args.tensor_parallel_size
    scheme, quant_findings = resolve_scheme(spec, args.quantization)
    weights = weight_bytes(spec, scheme, tp=tp, include_mtp=args.mtp)
    seqs, batched = _limits(args)
    kv_name, kv_bytes = kv_cache_bytes(args.kv_cache_dtype, model_precision(spec).name)
    layout = kv_layout_for(spec, kv_bytes, replace(args, max_num_batched_tokens=batched))
    overhead = estimate_overhead(
        spec,
        weights.total,
        OverheadInputs(
            tp, batched, seqs, args.enforce_eager, args.moe_backend, args.overhead_fraction
        ),
    )
    budget = int(cuda_visible_bytes(args.gpu_memory_bytes) * args.gpu_memory_utilization)
    kv_budget = budget - weights.total - overhead.total
    longest = longest_fitting_len(layout, kv_budget)
    if spec.max_position_embeddings:
        longest = min(longest, spec.max_position_embeddings)
    max_len = _max_model_len(spec, args, longest)
    plan = Plan(
        model=spec.name,
        args=args,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        quantization=scheme.label,
        kv_cache_dtype=kv_name,
        budget_bytes=budget,
        weights=weights,
        overhead=overhead,
        kv_budget_bytes=kv_budget,
        kv_bytes_per_token=attention_bytes_per_token_layer(spec, kv_bytes, tp)
        * spec.attention_layers,
        linear_state_bytes_per_seq=layout.mamba_page_bytes * spec.linear_attention_layers,
        hybrid=spec.is_hybrid,
        layout=layout,
        capacity=kv_capacity(layout, kv_budget, max_len),
        longest_fitting_len=longest,
        headroom_bytes=cuda_visible_bytes(args.gpu_memory_bytes)
        - budget
        - CUDA_CONTEXT_BYTES
        - overhead.graphs_after_sizing,
    )
    return replace(plan, findings=(*quant_findings, *plan_findings(spec, plan)))


def _validate(args: PlanArgs) -> None:
    if args.gpu_memory_bytes <= 0:
        raise PlanArgsError("GPU memory must be positive")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise PlanArgsError(
            f"gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.tensor_parallel_size < 1:
        raise PlanArgsError("tensor-parallel-size must be at least 1")
    if args.overhead_fraction is not None and not 0 <= args.overhead_fraction < 1:
        raise PlanArgsError("the overhead fraction must be in [0, 1)")


def _limits(args: PlanArgs) -> tuple[int, int]:
    seqs, batched = default_limits(args.gpu_memory_bytes)
    return args.max_num_seqs or seqs, args.max_num_batched_tokens or batched


def kv_layout_for(spec: ModelSpec, kv_bytes: float, args: PlanArgs) -> KvLayout:
    """The KV layout vLLM picks for ``spec`` (needs no GPU memory)."""
    tp = args.tensor_parallel_size
    per_token = attention_bytes_per_token_layer(spec, kv_bytes, tp)
    align = max(args.block_size or 0, DEFAULT_KERNEL_BLOCK)
    if spec.linear is None or not spec.is_hybrid:
        layers = AttentionLayers(
            full=spec.full_attention_layers,
            sliding=spec.sliding_attention_layers,
            window=spec.sliding_window or 0,
            chunked=spec.chunked_attention_layers,
            chunk=spec.attention_chunk_size or 0,
        )
        batched = args.max_num_batched_tokens or default_limits(args.gpu_memory_bytes)[1]
        block = args.block_size or (MLA_KERNEL_BLOCK if spec.mla else DEFAULT_KERNEL_BLOCK)
        return attention_layout(per_token, layers, block, batched)
    base = model_precision(spec).name
    _, conv = state_dtype(args.mamba_cache_dtype, base)
    ssm_requested = args.mamba_ssm_cache_dtype
    if ssm_requested in (None, "auto"):
        ssm_requested = spec.mamba_ssm_dtype  # Qwen3.5 configs say float32
    _, ssm = state_dtype(ssm_requested, base)
    mamba = linear_state_bytes_layer(spec.linear, tp, conv, ssm)
    return hybrid_layout(
        per_token,
        mamba,
        spec.full_attention_layers,
        spec.linear_attention_layers,
        align,
        prefix_caching=args.enable_prefix_caching,
    )


def _max_model_len(spec: ModelSpec, args: PlanArgs, longest: int) -> int:
    requested = args.max_model_len
    if requested is None or requested == -1:
        if requested == -1 and longest > 0:
            return longest  # vLLM's auto-fit: the longest that fits, capped by the model
        return spec.max_position_embeddings or longest
    if requested <= 0:
        raise PlanArgsError(f"max-model-len must be positive or -1, got {requested}")
    return requested
