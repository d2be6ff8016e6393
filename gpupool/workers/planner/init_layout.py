"""``gpupool init``'s decisions for a whole host: which GPUs run which worker, with which flags.

- GPUs are grouped by model (name, memory, compute capability). In each group, a worker runs on
  one GPU when one GPU holds the model, else on the smallest tensor-parallel group (2, 4, 8) that
  does; a GPU that cannot serve is left out, and said why.
- One KV cache dtype for the pool, so the model answers alike on every worker: the model's own
  dtype, unless a worker would then hold fewer full-length sequences than wanted and every GPU
  has FP8 (compute capability 8.9+): then ``fp8``, half the bytes per token (seed 000).
- Hybrid (Gated DeltaNet) models on cards of one architecture but different sizes: the largest
  card warms the shared Triton cache with a warm-up list, and the smaller ones start after it
  (seed 000's fix), so they may leave less memory outside vLLM's budget.

:class:`InitRefused` is raised when no GPU can serve the model, naming the reason per GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.errors import PlannerError
from gpupool.workers.planner.init_flags import (
    MIN_CONTEXT,
    WorkerFlags,
    WorkerTarget,
    choose_flags,
    fits,
    full_sequences,
    plan_target,
    utilization,
)
from gpupool.workers.planner.planning import default_limits
from gpupool.workers.planner.resolve import ResolvedModel

TP_SIZES = (1, 2, 4, 8)
DEFAULT_CONTEXT = 131072
FP8_KV_MIN_CC = (8, 9)
DEFAULT_WANTED_SEQS = 2
"""Full-length sequences per worker below which the KV cache goes fp8 (seed 000's two)."""


class InitRefused(PlannerError):
    """No GPU of the host can serve the model as asked; the message says why for each."""


@dataclass(frozen=True, slots=True)
class InitRequest:
    model: str
    context: int | None = None  # None: the model's maximum, at most DEFAULT_CONTEXT
    concurrency: int | None = None  # wanted sequences per worker; None: what the KV holds
    multimodal: bool | None = None  # None: yes when the model has a vision tower
    images: int = 2
    videos: int = 0
    quantization: str | None = None  # online quantization (fp8) of a bf16 checkpoint
    kv_cache_dtype: str | None = None  # None: chosen


@dataclass(frozen=True, slots=True)
class WorkerLayout:
    name: str
    flags: WorkerFlags
    start_after: tuple[str, ...] = ()
    warms: bool = False  # carries the warm-up list for the smaller cards


@dataclass(frozen=True, slots=True)
class PoolLayout:
    model: ResolvedModel
    request: InitRequest
    context: int
    kv_cache_dtype: str
    kv_why: str
    workers: tuple[WorkerLayout, ...]
    left_out: tuple[str, ...] = field(default_factory=tuple)  # GPUs not used, and why

    @property
    def multimodal(self) -> bool:
        wanted = self.request.multimodal
        return self.model.spec.vision is not None and wanted is not False


def group_gpus(gpus: Sequence[GpuInfo]) -> list[list[GpuInfo]]:
    groups: dict[tuple[str, int, tuple[int, int]], list[GpuInfo]] = {}
    for g in gpus:
        groups.setdefault((g.name, g.memory_total_bytes, g.compute_capability), []).append(g)
    return list(groups.values())


def plan_pool(model: ResolvedModel, gpus: Sequence[GpuInfo], req: InitRequest) -> PoolLayout:
    if not gpus:
        raise InitRefused("no GPU to plan for")
    spec = model.spec
    context = _context(spec.max_position_embeddings, req.context)
    fp8_ok = all(g.compute_capability >= FP8_KV_MIN_CC for g in gpus)
    probe_kv = req.kv_cache_dtype or ("fp8" if fp8_ok else "auto")
    groups, left_out = _tp_groups(model, gpus, probe_kv, req.quantization)
    if not groups:
        raise InitRefused(_refusal(model, left_out))
    warmer, warmed = _warm_partners(model, groups)
    kv, kv_why = _kv_dtype(model, groups, warmed, context, req, fp8_ok)
    workers: list[WorkerLayout] = []
    names = [_name(g) for g in groups]
    for group, name in zip(groups, names, strict=True):
        target = WorkerTarget(
            tuple(group), context, kv, req.concurrency, name in warmed, req.quantization
        )
        flags = choose_flags(spec, target)
        if isinstance(flags, str):
            left_out.append(f"{_gpu_list(group)}: {flags}")
            continue
        warms = warmer is not None and name == names[warmer]
        after = (names[warmer],) if name in warmed and warmer is not None else ()
        workers.append(WorkerLayout(name, flags, after, warms))
    if not workers:
        raise InitRefused(_refusal(model, left_out))
    return PoolLayout(model, req, context, kv, kv_why, tuple(workers), tuple(left_out))


def _context(model_max: int, wanted: int | None) -> int:
    limit = model_max or DEFAULT_CONTEXT
    if wanted is None:
        return min(limit, DEFAULT_CONTEXT)
    if wanted > limit:
        raise InitRefused(
            f"context {wanted} exceeds the model's max_position_embeddings {limit}; vLLM refuses it"
        )
    if wanted < MIN_CONTEXT:
        raise InitRefused(f"context {wanted} is below the {MIN_CONTEXT} tokens gpupool plans for")
    return wanted


def _tp_groups(
    model: ResolvedModel, gpus: Sequence[GpuInfo], kv: str, quant: str | None
) -> tuple[list[list[GpuInfo]], list[str]]:
    groups: list[list[GpuInfo]] = []
    left_out: list[str] = []
    for same in group_gpus(gpus):
        tp, why = _smallest_tp(model, same, kv, quant)
        if tp is None:
            left_out.append(f"{_gpu_list(same)}: {why}")
            continue
        n = len(same) // tp
        groups += [same[i * tp : (i + 1) * tp] for i in range(n)]
        if len(same) > n * tp:
            rest = same[n * tp :]
            left_out.append(f"{_gpu_list(rest)}: too few for another tensor-parallel-size {tp}")
    return groups, left_out


def _smallest_tp(
    model: ResolvedModel, same: list[GpuInfo], kv: str, quant: str | None
) -> tuple[int | None, str]:
    why = "no GPU"
    for tp in (t for t in TP_SIZES if t <= len(same)):
        problem = fits(model.spec, same[:tp], kv, quant)
        if problem is None:
            return tp, ""
        why = f"at tensor-parallel-size {tp}: {problem}"
    return None, why


def _warm_partners(
    model: ResolvedModel, groups: list[list[GpuInfo]]
) -> tuple[int | None, set[str]]:
    """The index of the worker that warms the Triton cache, and the names it warms."""
    if not model.spec.is_hybrid or len(groups) < 2:
        return None, set()
    biggest = max(range(len(groups)), key=lambda i: groups[i][0].memory_total_bytes)
    top = groups[biggest][0]
    warmed = {
        _name(g)
        for g in groups
        if g[0].compute_capability == top.compute_capability
        and g[0].memory_total_bytes < top.memory_total_bytes
    }
    return (biggest if warmed else None), warmed


def _kv_dtype(
    model: ResolvedModel,
    groups: list[list[GpuInfo]],
    warmed: set[str],
    context: int,
    req: InitRequest,
    fp8_ok: bool,
) -> tuple[str, str]:
    if req.kv_cache_dtype:
        return req.kv_cache_dtype, "as asked (--kv-cache-dtype)"
    wanted = req.concurrency or DEFAULT_WANTED_SEQS
    short = [
        (g, n)
        for g in groups
        if (n := _full_seqs(model, g, context, _name(g) in warmed, req.quantization)) < wanted
    ]
    if not short:
        return "auto", (
            f"the model's dtype (exact): every worker holds {wanted}+ sequences of "
            f"{context} tokens with it"
        )
    g, n = short[0]
    where = f"{_gpu_list(g)} holds {n} sequence(s) of {context} tokens with a bf16 cache"
    if not fp8_ok:
        return "auto", f"{where}; fp8 needs compute capability 8.9+ on every GPU"
    return "fp8", (
        f"{where}, fewer than {wanted}; fp8 halves the bytes per token (seed 000: how 128K fits "
        "on a 32 GB card); one dtype for the pool so every worker answers alike"
    )


def _full_seqs(
    model: ResolvedModel, group: list[GpuInfo], context: int, warmed: bool, quant: str | None
) -> int:
    t = WorkerTarget(tuple(group), context, "auto", warmed=warmed, quantization=quant)
    util, _ = utilization(model.spec, t.memory, warmed=warmed)
    _, batched = default_limits(t.memory)
    plan = plan_target(model.spec, t, util, context=context, seqs=1, batched=batched)
    return full_sequences(plan)


def _name(group: Sequence[GpuInfo]) -> str:
    short = group[0].name.lower()
    for noise in ("nvidia", "geforce", "blackwell", "generation", " with "):
        short = short.replace(noise, " ")
    slug = "-".join(short.replace("_", " ").split())
    tp = f"-tp{len(group)}" if len(group) > 1 else ""
    return f"{slug}{tp}-gpu{group[0].index}"


def _gpu_list(group: Sequence[GpuInfo]) -> str:
    indices = ",".join(str(g.index) for g in group)
    return f"GPU {indices} ({group[0].name}, {group[0].memory_total_bytes / (1 << 30):.1f} GiB)"


def _refusal(model: ResolvedModel, reasons: list[str]) -> str:
    lines = "\n".join(f"  - {r}" for r in reasons)
    hint = (
        "\n(gpu-memory-utilization keeps ~6.5 GiB per GPU outside vLLM's budget for the CUDA "
        "context and the Gated DeltaNet Triton autotuner, seed 000)"
        if model.spec.is_hybrid
        else ""
    )
    fixes = "; try --quantization fp8, a quantized checkpoint, a shorter --context or more GPUs"
    return f"{model.spec.name} cannot be served on this host:\n{lines}{hint}\n{fixes.lstrip('; ')}"
