"""The planner's input (:class:`PlanArgs`) and output (:class:`Plan`); all byte figures per GPU."""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.workers.planner.findings import Finding, has_errors
from gpupool.workers.planner.kv_layout import KvCapacity, KvLayout
from gpupool.workers.planner.memory import Overhead, Weights

VLLM_DEFAULT_UTILIZATION = 0.92
"""vLLM 0.32's default --gpu-memory-utilization (vllm-behaviour.md §5)."""


@dataclass(frozen=True, slots=True)
class PlanArgs:
    """What a vLLM launch decides about memory. ``None`` means vLLM's default."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float = VLLM_DEFAULT_UTILIZATION
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's maximum; -1: the longest that fits
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    moe_backend: str | None = None
    mtp: bool = False  # MTP speculative decoding loads the MTP weights
    mamba_cache_dtype: str | None = None
    mamba_ssm_cache_dtype: str | None = None
    overhead_fraction: float | None = None  # seed 001's 15-20 % rule instead of the estimate
    triton_cache_warmed: bool = False  # a larger same-architecture card warms the cache first


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    args: PlanArgs
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    quantization: str
    kv_cache_dtype: str
    budget_bytes: int  # gpu memory x utilization
    weights: Weights
    overhead: Overhead
    kv_budget_bytes: int  # budget - weights - overhead (may be negative)
    kv_bytes_per_token: int  # full-attention layers only
    linear_state_bytes_per_seq: int  # Gated DeltaNet conv + recurrent state, unpadded
    hybrid: bool
    layout: KvLayout
    capacity: KvCapacity
    longest_fitting_len: int
    headroom_bytes: int  # outside the budget, after the CUDA context
    findings: tuple[Finding, ...] = ()

    @property
    def can_start(self) -> bool:
        return not has_errors(self.findings)

    @property
    def verdict(self) -> str:
        if not self.can_start:
            return "cannot start"
        return "ok, with warnings" if self.findings else "ok"

    @property
    def tensor_parallel_size(self) -> int:
        return self.args.tensor_parallel_size
