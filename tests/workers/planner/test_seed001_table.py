"""Seed 001's sizing table, row by row, planned from the built-in shapes (no config.json needed).

The guide's method: weights = parameters named x bytes of the precision; runtime = weights +
15-20 % "activation and framework overhead"; KV cache = card x 0.9 - runtime. It works in decimal
GB with the card as marketed (80 GB x 0.9 = 72), and for tensor parallelism in totals over all
cards; so does this test.

Two differences are expected, and asserted rather than hidden:

- **Weights.** vLLM keeps the embeddings, the LM head and the vision tower in bf16 under fp8 or
  int8 (and an AWQ checkpoint keeps what its ``ignore`` list names), int4 stores a scale and a
  zero point per 128 weights (0.52 bytes, not 0.5), and the real parameter counts differ a
  little from the names. ``extra`` is what gpupool counts above the nominal bytes per parameter;
  gpupool's weights minus ``extra`` must match the guide within 6 %.
- **Overhead.** gpupool estimates it from the model's shapes (activations of one
  max-num-batched-tokens pass, the sampler over max-num-seqs rows, CUDA graphs, cuBLAS and NCCL
  buffers) instead of a share of the weights. That estimate reproduced seed 004's measured KV
  cache within 1 % and vLLM's on a real H200 within 0.45 % (issue 14), while 15-20 % of the
  weights grows with parameters that activations do not touch (60-80 GB for the 397B MoE, whose
  forward pass only sees 17B). So gpupool's own KV figure lies inside or above the guide's range:
  the guide is conservative, never short. With ``overhead_fraction`` the planner applies the
  guide's rule, and then runtime and KV land in the guide's ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpupool.workers.planner import PlanArgs, plan_from_args
from gpupool.workers.planner.params import count_params
from gpupool.workers.planner.plan import Plan
from gpupool.workers.planner.resolve import resolve_model

GB = 10**9
NOMINAL = {None: 2.0, "fp8": 1.0, "int8": 1.0, "awq": 0.5}


@dataclass(frozen=True)
class Row:
    model: str
    card_gb: int  # per GPU, as the guide writes it
    tp: int
    quant: str | None
    weights: float  # the guide's GB, all cards
    runtime: tuple[float, float]
    kv: tuple[float, float]


ROWS = {
    "9B fp8 on an RTX 4090": Row("Qwen/Qwen3.5-9B", 24, 1, "fp8", 9, (10.4, 10.8), (10.8, 11.2)),
    "9B fp16 on an L40S": Row("Qwen/Qwen3.5-9B", 48, 1, None, 18, (20.7, 21.6), (22, 23)),
    "27B fp8 on an H100": Row("Qwen/Qwen3.5-27B", 80, 1, "fp8", 27, (31, 32), (40, 41)),
    "27B fp16 on an A100": Row("Qwen/Qwen3.5-27B", 80, 1, None, 54, (62, 65), (7, 10)),
    "27B int8 on an A100": Row("Qwen/Qwen3.5-27B", 80, 1, "int8", 27, (31, 32), (40, 41)),
    "35B-A3B fp8 on an H100": Row("Qwen/Qwen3.5-35B-A3B", 80, 1, "fp8", 35, (40, 42), (30, 32)),
    "397B int4 on 4 H100": Row("Qwen/Qwen3.5-397B-A17B", 80, 4, "awq", 199, (230, 240), (48, 58)),
    "397B fp8 on 8 H100": Row("Qwen/Qwen3.5-397B-A17B", 80, 8, "fp8", 397, (457, 476), (100, 119)),
    "397B fp8 on 8 H200": Row("Qwen/Qwen3.5-397B-A17B", 141, 8, "fp8", 397, (457, 476), (539, 558)),
}


def plan_row(row: Row, fraction: float | None) -> Plan:
    args = PlanArgs(
        gpu_memory_bytes=row.card_gb * GB,
        gpu_memory_utilization=0.9,
        tensor_parallel_size=row.tp,
        quantization=row.quant,
        max_model_len=32768,
        overhead_fraction=fraction,
    )
    return plan_from_args(resolve_model(row.model).spec, args)


def extra_bytes(row: Row) -> float:
    """What gpupool counts above the guide's nominal bytes per parameter, over all cards: the
    parts kept in bf16, and the group scales and zero points of int4 (0.52 bytes, not 0.5)."""
    spec = resolve_model(row.model).spec
    weights = plan_row(row, None).weights.by_component
    nominal = NOMINAL[row.quant]
    return sum(max(0.0, weights[c] * row.tp - n * nominal) for c, n in count_params(spec).items())


@pytest.mark.parametrize("name", ROWS)
def test_row_by_the_guides_rule(name: str) -> None:
    row = ROWS[name]
    extra = extra_bytes(row)
    low, high = plan_row(row, 0.15), plan_row(row, 0.20)
    weights = (low.weights.total * row.tp - extra) / GB
    assert weights == pytest.approx(row.weights, rel=0.06)
    # runtime = weights x 1.15..1.20, compared on the guide's weights basis
    runtime = (
        (low.weights.total + low.overhead.total) * row.tp - 1.15 * extra,
        (high.weights.total + high.overhead.total) * row.tp - 1.20 * extra,
    )
    assert runtime[0] / GB == pytest.approx(row.runtime[0], rel=0.06)
    assert runtime[1] / GB == pytest.approx(row.runtime[1], rel=0.06)
    cap = row.card_gb * row.tp * 0.9 * GB
    kv = ((cap - runtime[1]) / GB, (cap - runtime[0]) / GB)  # the higher overhead, the less KV
    tolerance = max(2.5, 0.1 * row.kv[1])  # the guide rounds weights to the model's name
    assert kv[0] == pytest.approx(row.kv[0], abs=tolerance)
    assert kv[1] == pytest.approx(row.kv[1], abs=tolerance)


@pytest.mark.parametrize("name", ROWS)
def test_row_by_gpupools_estimate(name: str) -> None:
    """The planner's own figures: it starts, and its KV cache is never below the guide's rule
    applied to the same weights (the guide's 20 % end)."""
    row = ROWS[name]
    estimate, rule = plan_row(row, None), plan_row(row, 0.20)
    assert estimate.can_start
    assert estimate.kv_budget_bytes >= rule.kv_budget_bytes
    assert estimate.overhead.total < 0.20 * estimate.weights.total


def test_27b_on_an_h200_has_room_for_the_full_262k_window() -> None:
    """ "H200 141GB: FP8 and FP16 both fit with substantial KV cache headroom ... up to the full
    262K native window"."""
    spec = resolve_model("Qwen/Qwen3.5-27B").spec
    for quant in ("fp8", None):
        args = PlanArgs(141 * GB, 0.9, quantization=quant, max_model_len=262144)
        p = plan_from_args(spec, args)
        assert p.can_start and p.capacity.max_concurrency >= 2


def test_122b_fp8_needs_two_h100s() -> None:
    """ "at FP8, the 122B-A10B requires approximately 2x H100 80GB"."""
    spec = resolve_model("Qwen/Qwen3.5-122B-A10B").spec
    one = plan_from_args(spec, PlanArgs(80 * GB, 0.9, quantization="fp8", max_model_len=32768))
    two = plan_from_args(spec, PlanArgs(80 * GB, 0.9, 2, quantization="fp8", max_model_len=32768))
    assert not one.can_start and two.can_start


@pytest.mark.parametrize(
    ("model", "card_gb", "tp", "quant"),
    [
        ("Qwen/Qwen3.5-27B", 24, 1, None),  # "27B on a single RTX 4090 at FP16: not possible"
        ("Qwen/Qwen3.5-397B-A17B", 80, 2, "fp8"),  # "397B on 2x H100 at FP8: not enough"
    ],
)
def test_what_wont_work(model: str, card_gb: int, tp: int, quant: str | None) -> None:
    spec = resolve_model(model).spec
    p = plan_from_args(spec, PlanArgs(card_gb * GB, 0.9, tp, quantization=quant))
    assert not p.can_start
    assert any(f.message.startswith("cannot start: the weights need") for f in p.findings)
