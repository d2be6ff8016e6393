"""One worker's vLLM flags, chosen by the planner (``gpupool init``); each with its reason.

Pure functions of a :class:`ModelSpec`, a set of identical GPUs and what the user wants:

- ``gpu-memory-utilization``: the card minus what must stay outside vLLM's budget: the CUDA
  context, and for hybrid Gated DeltaNet models the Triton autotuner's scratch on the first
  request (seed 000: 4-8 GB; 6 GiB kept), or less on a card whose Triton cache a larger card of
  the same architecture warms first (``start_after``);
- ``max-model-len``: the wanted context, shortened only when one sequence does not fit;
- ``max-num-seqs``: the number of full-length sequences the KV cache holds (at most the wanted
  concurrency, and vLLM's default for the card);
- ``max-num-batched-tokens``: vLLM's default for the card, raised to the hybrid attention block
  (seed 000: 2096 tokens with an fp8 KV cache).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.findings import Level
from gpupool.workers.planner.memory import CUDA_CONTEXT_BYTES, GiB
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.plan import Plan, PlanArgs
from gpupool.workers.planner.planning import default_limits, plan_from_args
from gpupool.workers.planner.verdicts import TRITON_AUTOTUNE_HEADROOM, WARM_CACHE_HEADROOM

MAX_UTILIZATION = 0.95
PLAIN_HEADROOM = 3 * GiB // 2
"""Outside the budget for a model without Triton-autotuned layers: allocator slack, NCCL."""
MIN_CONTEXT = 4096
CONTEXT_STEP = 1024


@dataclass(frozen=True, slots=True)
class WorkerTarget:
    """What one worker is asked for; the flags follow from it."""

    gpus: tuple[GpuInfo, ...]
    context: int
    kv_cache_dtype: str
    max_seqs: int | None = None  # the wanted concurrency (None: what the KV cache holds)
    warmed: bool = False  # a larger card of the same architecture fills the Triton cache first
    quantization: str | None = None

    @property
    def memory(self) -> int:
        return min(g.memory_total_bytes for g in self.gpus)

    @property
    def tp(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True, slots=True)
class WorkerFlags:
    target: WorkerTarget
    plan: Plan
    utilization_why: str
    context_why: str
    seqs_why: str
    batched_why: str


def utilization(spec: ModelSpec, memory: int, *, warmed: bool) -> tuple[float, str]:
    """The fraction of a card vLLM may take, and why."""
    if spec.is_hybrid:
        extra = WARM_CACHE_HEADROOM if warmed else TRITON_AUTOTUNE_HEADROOM
        what = (
            "the Triton autotuner's scratch for the shapes the warm-up did not cover "
            "(the larger card filled the shared Triton cache first)"
            if warmed
            else "the Triton autotuner of the Gated DeltaNet kernels, which allocates 4-8 GB "
            "outside vLLM's budget on the first request (seed 000)"
        )
    else:
        extra, what = PLAIN_HEADROOM, "allocator slack and communication buffers"
    outside = extra + CUDA_CONTEXT_BYTES
    util = min(MAX_UTILIZATION, math.floor((1 - outside / memory) * 100) / 100)
    left = memory * (1 - util)
    why = (
        f"{util} of {memory / GiB:.1f} GiB: {left / GiB:.1f} GiB stay outside vLLM's budget for "
        f"the CUDA context (~{CUDA_CONTEXT_BYTES / GiB:.1f} GiB) and {what}"
    )
    return util, why


def plan_target(
    spec: ModelSpec, t: WorkerTarget, util: float, *, context: int, seqs: int, batched: int
) -> Plan:
    args = PlanArgs(
        gpu_memory_bytes=t.memory,
        gpu_memory_utilization=util,
        tensor_parallel_size=t.tp,
        max_model_len=context,
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        kv_cache_dtype=t.kv_cache_dtype,
        quantization=t.quantization,
        triton_cache_warmed=t.warmed,
    )
    return plan_from_args(spec, args)


def errors_of(plan: Plan) -> list[str]:
    return [f.message for f in plan.findings if f.level is Level.error]


def full_sequences(plan: Plan) -> int:
    """Sequences of ``max_model_len`` tokens the KV cache holds at once (0 when an error)."""
    return 0 if errors_of(plan) else math.floor(plan.capacity.max_concurrency)


def choose_flags(spec: ModelSpec, t: WorkerTarget) -> WorkerFlags | str:
    """The worker's flags, or why no flags make the model fit these GPUs."""
    util, util_why = utilization(spec, t.memory, warmed=t.warmed)
    default_seqs, default_batched = default_limits(t.memory)
    probe = plan_target(spec, t, util, context=t.context, seqs=1, batched=default_batched)
    batched = max(default_batched, probe.layout.block_size if probe.hybrid else 0)
    batched_why = _batched_why(probe, default_batched, batched)
    probe = plan_target(spec, t, util, context=t.context, seqs=1, batched=batched)
    context, context_why = _context(probe, t.context)
    if context < MIN_CONTEXT:
        return _no_fit(probe)
    cap = min(t.max_seqs or default_seqs, default_seqs)
    plan = plan_target(spec, t, util, context=context, seqs=1, batched=batched)
    seqs = max(1, min(cap, full_sequences(plan)))
    plan = plan_target(spec, t, util, context=context, seqs=seqs, batched=batched)
    while seqs > 1 and full_sequences(plan) < seqs:  # the sampler grew with the sequences
        seqs -= 1
        plan = plan_target(spec, t, util, context=context, seqs=seqs, batched=batched)
    if errors_of(plan):
        return _no_fit(plan)
    return WorkerFlags(t, plan, util_why, context_why, _seqs_why(plan, seqs, t, cap), batched_why)


def _context(probe: Plan, wanted: int) -> tuple[int, str]:
    if full_sequences(probe) >= 1:
        return wanted, f"the wanted context, {wanted} tokens; one such sequence fits"
    longest = probe.longest_fitting_len // CONTEXT_STEP * CONTEXT_STEP
    why = (
        f"shortened from the wanted {wanted}: after the weights "
        f"({probe.weights.total / GiB:.1f} GiB) this card's KV budget "
        f"({max(0, probe.kv_budget_bytes) / GiB:.1f} GiB) holds one sequence of at most "
        f"{probe.longest_fitting_len} tokens"
    )
    return longest, why


def _no_fit(plan: Plan) -> str:
    errors = errors_of(plan)
    if errors:
        return errors[0]
    return (
        f"not even a {MIN_CONTEXT}-token sequence fits: KV budget "
        f"{plan.kv_budget_bytes / GiB:.2f} GiB after {plan.weights.total / GiB:.1f} GiB of weights"
    )


def _seqs_why(plan: Plan, seqs: int, t: WorkerTarget, cap: int) -> str:
    holds = plan.capacity.max_concurrency
    why = (
        f"the KV cache ({plan.capacity.num_blocks} blocks) holds {holds:.2f} sequences of "
        f"{plan.max_model_len} tokens"
    )
    if seqs == cap and holds >= cap + 1:
        limit = "the wanted concurrency" if t.max_seqs else "vLLM's default for this card"
        why += f"; capped at {cap}, {limit}"
    return why


def _batched_why(probe: Plan, default: int, batched: int) -> str:
    if batched == default:
        block = f"; above the hybrid block of {probe.layout.block_size}" if probe.hybrid else ""
        return f"vLLM's default for this card size{block}"
    return (
        f"raised from vLLM's default {default} to the hybrid attention block "
        f"{probe.layout.block_size}: vLLM refuses a smaller value (seed 000)"
    )


def fits(spec: ModelSpec, gpus: Sequence[GpuInfo], kv: str, quant: str | None) -> str | None:
    """None when ``spec`` holds a :data:`MIN_CONTEXT` sequence on ``gpus`` (one TP group), else
    why not."""
    t = WorkerTarget(tuple(gpus), MIN_CONTEXT, kv, quantization=quant)
    util, _ = utilization(spec, t.memory, warmed=False)
    _, batched = default_limits(t.memory)
    plan = plan_target(spec, t, util, context=MIN_CONTEXT, seqs=1, batched=batched)
    plan = plan_target(
        spec, t, util, context=MIN_CONTEXT, seqs=1, batched=max(batched, plan.layout.block_size)
    )
    return None if full_sequences(plan) >= 1 else _no_fit(plan)
