"""What a computed :class:`Plan` means: "cannot start" errors and the seeds' warnings.

Paths are relative to a worker's ``launch`` block (``args.max-model-len``, ``gpus``);
:func:`gpupool.workers.planner.checks.check_launch_config` prefixes ``workers[i].launch``.
"""

from __future__ import annotations

import math

from gpupool.workers.planner.findings import Finding, error, warning
from gpupool.workers.planner.memory import (
    CUDA_CONTEXT_BYTES,
    CUDA_RESERVED_BYTES,
    GiB,
    MiB,
    cuda_visible_bytes,
)
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.plan import Plan

TRITON_AUTOTUNE_HEADROOM = 6 * GiB
"""Free memory the GDN Triton autotuner needs outside vLLM's budget on the first request.
Seed 000: "4-8 GB"; ~5.5 GB free on a 32 GB RTX 5090 (0.83) failed, while ~7.6 GiB on a 96 GB
RTX PRO 6000 (0.92) worked; 6 GiB lies between the two."""
WARM_CACHE_HEADROOM = 19 * GiB // 4
"""The same, on a card whose Triton cache a larger card of the same architecture warmed first
(``start_after`` a worker with a warm-up list): only shapes the warm-up missed still autotune.
Seed 000 ran its warmed 32 GB card at 0.83: 4.9 GiB outside the budget after the CUDA context;
4.75 GiB is kept."""
B12X_SMALL_CARD = 48 * GiB


def gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_findings(spec: ModelSpec, plan: Plan) -> list[Finding]:
    fit = _fit_findings(plan)
    findings = [*tp_findings(spec, plan.tensor_parallel_size), *_length_findings(spec, plan), *fit]
    if not fit:
        findings += _capacity_findings(plan)
    findings += _hybrid_findings(plan)
    findings += _backend_findings(plan)
    return findings


def tp_findings(spec: ModelSpec, tp: int) -> list[Finding]:
    """vLLM shards heads across ranks: every head count must divide by TP (KV heads may be
    replicated instead, when TP is a multiple of them)."""
    counts = {"attention heads": spec.attention.num_heads}
    if spec.linear is not None and spec.is_hybrid:
        counts["linear-attention key heads"] = spec.linear.num_key_heads
        counts["linear-attention value heads"] = spec.linear.num_value_heads
    bad = [f"{name} ({n})" for name, n in counts.items() if n % tp]
    kv = spec.attention.num_kv_heads
    if kv % tp and tp % kv:
        bad.append(f"KV heads ({kv})")
    if not bad:
        return []
    message = f"cannot start: tensor-parallel-size {tp} does not divide the {', '.join(bad)}"
    return [error("args.tensor-parallel-size", message)]


def _length_findings(spec: ModelSpec, plan: Plan) -> list[Finding]:
    limit = spec.max_position_embeddings
    if not limit or plan.max_model_len <= limit:
        return []
    message = (
        f"cannot start: max-model-len {plan.max_model_len} exceeds the model's "
        f"max_position_embeddings {limit} (vLLM refuses unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"
    )
    return [error("args.max-model-len", message)]


def _fit_findings(plan: Plan) -> list[Finding]:
    weights = plan.weights.total
    total = plan.args.gpu_memory_bytes
    where = f"{gib(total)} x {plan.args.gpu_memory_utilization}"
    if weights > plan.budget_bytes:
        return [
            error(
                "gpus",
                f"cannot start: the weights need {gib(weights)} per GPU but the budget is "
                f"{gib(plan.budget_bytes)} ({where}); use more GPUs (tensor-parallel-size), "
                "a smaller quantization or a larger card",
            )
        ]
    if plan.kv_budget_bytes <= 0:
        return [
            error(
                "gpus",
                f"cannot start: nothing is left for the KV cache: weights {gib(weights)} + "
                f"overhead {gib(plan.overhead.total)} ≥ budget {gib(plan.budget_bytes)} ({where})",
            )
        ]
    return []


def _capacity_findings(plan: Plan) -> list[Finding]:
    cap = plan.capacity
    if cap.num_blocks < cap.blocks_per_request:
        need = cap.blocks_per_request * plan.layout.block_bytes
        fix = (
            f"the longest that fits is {plan.longest_fitting_len} tokens"
            if plan.longest_fitting_len
            else "not even one block fits"
        )
        return [
            error(
                "args.max-model-len",
                f"cannot start: one {plan.max_model_len}-token sequence needs {gib(need)} of KV "
                f"cache ({cap.blocks_per_request} blocks of {plan.layout.block_bytes / MiB:.1f} "
                f"MiB) but the KV budget is {gib(plan.kv_budget_bytes)}; {fix}; "
                + _capacity_remedy(plan),
            )
        ]
    if plan.args.max_num_seqs is not None and cap.max_concurrency < plan.max_num_seqs:
        return [
            warning(
                "args.max-num-seqs",
                f"the KV cache holds {cap.max_concurrency:.2f} sequences of {plan.max_model_len} "
                f"tokens, fewer than max-num-seqs {plan.max_num_seqs}: requests that grow long "
                "together wait or are preempted",
            )
        ]
    return []


def _capacity_remedy(plan: Plan) -> str:
    remedy = "lower max-model-len or raise gpu-memory-utilization"
    if not plan.kv_cache_dtype.startswith("fp8"):
        remedy += " or use kv-cache-dtype fp8 (half the bytes per token)"
    return remedy


def _hybrid_findings(plan: Plan) -> list[Finding]:
    if not plan.hybrid:
        return []
    out: list[Finding] = []
    if plan.args.enable_prefix_caching:
        out += batched_tokens_findings(
            plan.layout.block_size, plan.max_num_batched_tokens, plan.layout.mamba_page_bytes
        )
    warmed = plan.args.triton_cache_warmed
    if plan.headroom_bytes < (WARM_CACHE_HEADROOM if warmed else TRITON_AUTOTUNE_HEADROOM):
        out.append(_triton_warning(plan))
    return out


def batched_tokens_findings(block: int, batched: int, mamba_page: int) -> list[Finding]:
    """Seed 000: max-num-batched-tokens must be at least the hybrid attention block size."""
    if batched >= block:
        return []
    message = (
        f"max-num-batched-tokens {batched} is below the hybrid attention block size {block} "
        f"(vLLM grows the block until one attention page holds a {mamba_page:,}-byte Gated "
        f'DeltaNet state); vLLM before the scheduler fix refuses to start ("block_size '
        f'({block}) must be <= max_num_batched_tokens"); set it to at least {block} (seed 000)'
    )
    return [warning("args.max-num-batched-tokens", message)]


def _triton_warning(plan: Plan) -> Finding:
    total = plan.args.gpu_memory_bytes
    util = plan.args.gpu_memory_utilization
    message = (
        f"only {gib(plan.headroom_bytes)} stays outside gpu-memory-utilization {util} "
        f"(({gib(total)} - {gib(CUDA_RESERVED_BYTES)} the driver keeps) x {1 - util:.2f} "
        f"- ~{gib(CUDA_CONTEXT_BYTES)} CUDA context); the Triton "
        "autotuner of the Gated DeltaNet kernels allocates 4-8 GB outside vLLM's budget on the "
        "first request and runs out of memory (seed 000: ~5.5 GB free failed); "
        + _triton_remedy(plan)
    )
    if plan.args.enforce_eager:
        message += "; --enforce-eager does not help (the autotuner is not a CUDA graph)"
    return warning("args.gpu-memory-utilization", message)


def _triton_remedy(plan: Plan) -> str:
    total = cuda_visible_bytes(plan.args.gpu_memory_bytes)
    safe = math.floor((1 - (TRITON_AUTOTUNE_HEADROOM + CUDA_CONTEXT_BYTES) / total) * 100) / 100
    kv = int(total * safe) - plan.weights.total - plan.overhead.total
    one = plan.layout.bytes_per_request(plan.max_model_len)
    warm = "warm TRITON_CACHE_DIR on a larger card with the same compute capability and reuse it"
    if safe > 0 and kv >= one:
        return (
            f"lower gpu-memory-utilization to {safe:.2f} (KV cache {gib(kv)}, "
            f"{kv / one:.2f} sequences of {plan.max_model_len} tokens) or {warm}"
        )
    return f"lowering gpu-memory-utilization to {safe:.2f} leaves no room for one sequence: {warm}"


def _backend_findings(plan: Plan) -> list[Finding]:
    if not plan.overhead.backend_workspace or plan.args.gpu_memory_bytes >= B12X_SMALL_CARD:
        return []
    message = (
        f"moe-backend {plan.args.moe_backend} reserves ~{gib(plan.overhead.backend_workspace)} "
        "more than marlin before the KV cache is sized and failed during profiling on 16 and "
        "32 GB cards (seed 004); gpu-memory-utilization cannot help; use marlin"
    )
    return [warning("args.moe-backend", message)]
